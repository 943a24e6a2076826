"""Each algorithm option reaches the step: KL in the reward, remax's greedy baseline, DAPO's
overlong shaping, the critic's values, and the config checks that refuse broken combinations."""
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.runtime.sync_controller import SyncController
from asyncrl.runtime.validate import validate_config
from asyncrl.types import Completion, Example, RequestOutput, TrainBatch


class FakeTokenizer:
    pad_token_id = 0

    def __call__(self, text):
        return {"input_ids": [1 + ord(ch) % 20 for ch in text]}


class FakeBackend:
    """Sampled completions cycle through ``texts``; greedy ones are always ``greedy_text``."""

    def __init__(self, texts, greedy_text="right"):
        self.texts, self.greedy_text, self.calls = texts, greedy_text, []

    def generate(self, prompt_ids, params):
        self.calls.append(params.temperature)
        texts = [self.greedy_text] if params.greedy else self.texts
        return [RequestOutput(list(p), None, [Completion([3] * len(t), t, [0.0] * len(t), "stop")
                                               for t in (texts * params.n)[:params.n]]) for p in prompt_ids]


def reward(prompt, response, **fields):
    return 1.0 if response == "right" else 0.0


def _controller(*overrides, texts=("right", "wrong", "wrong", "wrong")):
    cfg = load_config(None, ["rollout.n=4", "trainer.prompts_per_step=2", "rollout.max_tokens=6", *overrides])
    stream = iter([Example("1+1=", "2"), Example("2+2=", "4"), Example("3+3=", "6"), Example("4+4=", "8")])
    return SyncController(cfg, actor=None, reference=None, backend=FakeBackend(list(texts)),
                          tokenizer=FakeTokenizer(), reward_fn=reward, prompt_stream=stream)


def _batch(scores, old, ref) -> TrainBatch:
    size, length = old.shape
    return TrainBatch(input_ids=torch.zeros(size, 2 + length, dtype=torch.long),
                      attention_mask=torch.ones(size, 2 + length, dtype=torch.long),
                      response_mask=torch.ones(size, length), prompt_length=2,
                      rollout_logprobs=torch.zeros(size, length), token_versions=torch.zeros(size, length).long(),
                      scores=torch.tensor(scores), group_ids=torch.zeros(size, dtype=torch.long),
                      old_logprobs=old, ref_logprobs=ref)


def test_kl_in_reward_folds_beta_kl_into_token_rewards_and_adapts_beta():
    ctrl = _controller("algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                       "algorithm.kl_ctrl.kl_coef=0.5", "algorithm.kl_ctrl.target_kl=0.1",
                       "algorithm.kl_ctrl.horizon=10", "algorithm.norm_adv_by_std_in_grpo=false")
    old = torch.tensor([[-1.0, -1.0], [-2.0, -0.5]])
    ref = torch.tensor([[-1.5, -1.0], [-2.0, -1.5]])
    batch = _batch([1.0, 0.0], old, ref)
    metrics = ctrl.token_rewards(batch)
    # k1 = old − ref = [[0.5, 0], [0, 1]]; rewards = score on the last token − 0.5·k1
    torch.testing.assert_close(batch.token_rewards, torch.tensor([[-0.25, 1.0], [0.0, -0.5]]))
    # current KL = mean of per-row token means = (0.25 + 0.5)/2 = 0.375 > target: e = +0.2,
    # β ← 0.5·(1 + 0.2·2/10) = 0.52
    assert metrics == {"kl/reward_kl": pytest.approx(0.375), "kl/reward_coef": 0.5}
    assert ctrl.kl_ctrl.value == pytest.approx(0.52)
    ctrl.advantages(batch)  # Dr. GRPO on R_i = Σ_t token_rewards = [0.75, −0.5]: R − mean = ±0.625 (not ±0.5)
    torch.testing.assert_close(batch.advantages, torch.tensor([[0.625, 0.625], [-0.625, -0.625]]))


def test_kl_in_reward_off_leaves_token_rewards_unset():
    ctrl = _controller()
    batch = _batch([1.0, 0.0], torch.zeros(2, 2), torch.ones(2, 2))
    assert ctrl.token_rewards(batch) == {} and batch.token_rewards is None


def test_remax_uses_a_greedy_rollout_per_prompt_as_baseline():
    ctrl = _controller("algorithm.adv_estimator=remax")
    groups = ctrl.generate_round(step=1, round_index=0)
    assert ctrl.backend.calls == [1.0, 0.0]       # one sampled round, then one greedy round
    assert groups.baselines == [1.0, 1.0]         # greedy text "right" scores 1
    batch = _batch(groups.flat("scores"), torch.zeros(8, 5), torch.zeros(8, 5))
    batch.group_ids = torch.arange(2).repeat_interleave(4)
    ctrl.advantages(batch, groups.baselines)
    # remax: A_t = reward-to-go − b = score − 1 on every token: 0 for "right", −1 for "wrong"
    expected = (torch.tensor(groups.flat("scores")) - 1.0)[:, None].expand(8, 5)
    torch.testing.assert_close(batch.advantages, expected)


def test_no_greedy_rollout_without_remax():
    ctrl = _controller()
    groups = ctrl.generate_round(step=1, round_index=0)
    assert ctrl.backend.calls == [1.0] and groups.baselines is None


def test_overlong_penalty_shapes_the_score_but_not_the_accuracy():
    # max_tokens 6, buffer 2: lengths 5 ("right") and 6 ("sixsix") are penalised by 1/2·f and 1·f
    ctrl = _controller("algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=2",
                       "algorithm.overlong_buffer.penalty_factor=0.5", texts=("right", "sixsix", "ok", "ok"))
    example = Example("1+1=", "2")
    output = ctrl.backend.generate([[1]], ctrl.params)[0]
    scores, correct = ctrl.score(example, output)
    assert correct == [1.0, 0.0, 0.0, 0.0]
    assert scores == pytest.approx([1.0 - 0.25, -0.5, 0.0, 0.0])


def test_dynamic_sampling_in_the_controller_drops_constant_groups():
    ctrl = _controller("algorithm.filter_groups.enable=true",
                       texts=("right", "wrong", "wrong", "wrong"))  # every group varies
    groups, generated, metrics = ctrl.collect(step=1)
    assert len(groups) == 2 and metrics["dynamic_sampling/rounds"] == 1.0
    ctrl = _controller("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2",
                       texts=("wrong",))  # all wrong: never enough
    with pytest.raises(RuntimeError, match="max_num_gen_batches=2"):
        ctrl.collect(step=1)


@pytest.mark.parametrize("overrides, fragment", [
    (["algorithm.adv_estimator=gae"], "critic.enable=true"),
    (["critic.enable=true"], "never reads values"),
    (["algorithm.decoupled=true"], "rollout_correction.level"),
    (["algorithm.policy_loss=pg", "actor.mini_batches=2"], "one optimizer step per batch"),
    (["algorithm.kl_ctrl.type=adaptive"], "use_kl_in_reward=true"),
    (["algorithm.filter_groups.enable=true", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.kl_penalty=k4"], "algorithm.kl_penalty"),
])
def test_broken_combinations_are_refused_with_a_reason(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.").replace("(", r"\(")):
        validate_config(load_config(None, overrides))


def test_every_recipe_passes_validation():
    for name in ("grpo", "dr_grpo", "dapo", "gspo", "sapo", "ppo", "rloo", "reinforce_pp"):
        validate_config(load_config(name))
