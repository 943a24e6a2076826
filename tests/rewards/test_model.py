"""Reward-model reward with a tiny, randomly initialised model saved to a tmp dir."""
import pytest

from asyncrl.rewards.model import RewardModel, reward_model, reward_model_batch
from asyncrl.rewards.pool import RewardPool, RewardRequest, RewardSpec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "</s>", "what", "is", "two", "plus", "two", "four", "five", "?", "it"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_batched_scores_match_one_at_a_time(model_dir):
    rm = RewardModel(model_dir, batch_size=3)
    prompts = ["what is two plus two ?"] * 4
    responses = [" it is four", " five", " it is five it is five", " four"]
    batched = rm.score_batch(prompts, responses)
    single = [rm.score_batch([p], [r])[0] for p, r in zip(prompts, responses)]
    assert batched == pytest.approx(single, abs=1e-5)  # right padding does not leak into scores
    assert len(set(round(s, 6) for s in batched)) == 4


def test_reward_functions_and_pool(model_dir):
    direct = reward_model("what is two plus two ?", " four", model_path=model_dir)
    assert isinstance(direct, float)
    assert reward_model_batch(["what is two plus two ?"], [" four"], [{}], model_path=model_dir) == [direct]
    spec = RewardSpec("rm", "reward_model", kwargs={"model_path": model_dir})
    with RewardPool([spec], mode="inline") as pool:
        [result] = pool.score([RewardRequest("what is two plus two ?", " four")])
    assert result.total == pytest.approx(direct) and result.failed == {}
    with pytest.raises(ValueError, match="model_path"):
        reward_model("p", "r")
