"""1,000 multi-turn episodes on the engine: the trainer trains exactly the sampled token ids, and
its recomputed log-probs match the engine's sampling log-probs (fp32, <= 1e-4)."""
from __future__ import annotations

import random

import torch

from asyncrl.rollout.engine_backend import EngineBackend
from asyncrl.training.batch import build_train_batch
from asyncrl.training.logprobs import response_logprobs
from asyncrl.types import Example, SamplingParams
from asyncrl.workflows.backend import WorkflowBackend
from asyncrl.workflows.generators import EngineGenerator
from tests.serve.chat_fixtures import chat_tokenizer, tiny_model

EPISODES_PER_EXAMPLE, EXAMPLES = 8, 125  # 1,000 episodes


async def two_turns(client, example):
    """user -> reply -> user -> reply; the reward depends on what was said."""
    messages = [{"role": "user", "content": example.prompt}]
    for follow_up in ("go on", None):
        response = await client.chat.completions.create(model="policy", messages=messages)
        messages = messages + [response.choices[0].message]
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return float(len(response.choices[0].message.content or "") % 2)


class RecordingGenerator(EngineGenerator):
    """The engine's completions per session, in turn order (what was actually sampled)."""

    def __init__(self, engine, log):
        super().__init__(engine)
        self.log = log

    async def generate(self, prompt_ids, params, session_id):
        completion = await super().generate(prompt_ids, params, session_id)
        self.log.setdefault(session_id, []).append(completion)
        return completion


def test_multi_turn_tokens_and_logprobs_are_exact(tmp_path):
    torch.manual_seed(0)
    tok = chat_tokenizer("qwen3", tmp_path)
    model = tiny_model(tok, seed=1, max_len=512).eval()
    engine = EngineBackend(model, tok, dtype=torch.float32, device="cpu", num_kv_blocks=2048, block_size=16)
    backend = WorkflowBackend(engine, two_turns, tok, max_total_tokens=400)
    log: dict = {}
    backend._generator = lambda: RecordingGenerator(backend._engine_started(), log)
    rng = random.Random(0)
    examples = [Example(prompt=f"say {rng.randint(0, 999)}", answer="", uid=f"e{i}") for i in range(EXAMPLES)]
    outputs = backend.generate_examples(examples, SamplingParams(n=EPISODES_PER_EXAMPLE, temperature=1.0,
                                                                 max_tokens=5, seed=7))
    backend.close()
    completions = [c for out in outputs for c in out.completions]
    assert len(completions) == 1000 and all(c.info["turns"] == 2 for c in completions)
    batch = build_train_batch(outputs, [c.reward for c in completions], tok.pad_token_id)
    P = batch.prompt_length
    for row, c in enumerate(completions):
        n = len(c.token_ids)
        trained = batch.input_ids[row, P:P + n]
        mask = batch.response_mask[row, :n].bool()
        sampled = [t for turn in log[c.info["session_id"]] for t in turn.token_ids]
        assert trained[mask].tolist() == sampled  # the trained ids are the sampled ones, in order
        assert trained.tolist() == c.token_ids    # and the inserted ones sit between them unchanged
        assert batch.token_versions[row, :n][~mask].eq(-1).all()
    with torch.no_grad():
        recomputed = torch.cat([response_logprobs(model, batch.input_ids[i:i + 100], batch.attention_mask[i:i + 100],
                                                  P, temperature=1.0)[0] for i in range(0, 1000, 100)])
    mask = batch.response_mask.bool()
    gap = (recomputed - batch.rollout_logprobs).abs()[mask]
    assert mask.sum() > 5_000 and gap.max().item() <= 1e-4, gap.max().item()
