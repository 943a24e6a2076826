"""Routing replay (R3): the engine returns each token's experts, the trainer's forward reuses them.

Tiny random Qwen3-MoE and Qwen3.5-MoE checkpoints (tests/engine/families.py), CPU fp32: the
engine samples, ``build_train_batch`` lays the routing out like the tokens, and the trainer's
recomputed log-probs (HF model + router hooks) equal the engine's to fp32 precision.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from families import build_family  # noqa: E402

from asyncrl.engine import LLM  # noqa: E402
from asyncrl.training.batch import build_train_batch  # noqa: E402
from asyncrl.training.logprobs import response_logprobs  # noqa: E402
from asyncrl.training.routing_replay import RoutingReplay, find_routers  # noqa: E402
from asyncrl.types import SamplingParams  # noqa: E402


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def rollout(request, tmp_path_factory):
    """(HF model, train batch with the engine's routing and log-probs) for one MoE family."""
    from transformers import AutoModelForCausalLM

    path = build_family(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype=torch.float32, device="cpu", block_size=4, max_num_seqs=8, return_routed_experts=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 97, (n,), generator=g).tolist() for n in (5, 9)]
    outs = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=1, ignore_eos=True))
    batch = build_train_batch(outs, [0.0] * 4, pad_id=0)
    return hf, batch


def _logprobs(hf, batch):
    return response_logprobs(hf, batch.input_ids, batch.attention_mask, batch.prompt_length, share_prompts=False,
                             pack_bin_tokens=0)[0]


def test_engine_returns_routing_in_the_token_layout(rollout):
    hf, batch = rollout
    layers, k = len(find_routers(hf)), hf.config.num_experts_per_tok
    B, T = batch.input_ids.shape
    assert batch.routed_experts.shape == (B, T, layers, k) and batch.routed_experts.dtype == torch.int16
    # every real token but each row's last (column P + response length - 1) went through the engine
    expected = batch.attention_mask.bool().clone()
    last = batch.prompt_length + batch.response_mask.sum(1).long() - 1
    expected[torch.arange(B), last] = False
    assert torch.equal(batch.routing_mask, expected)


def test_replay_gives_the_engine_logprobs_and_mismatch_is_measured(rollout):
    hf, batch = rollout
    mask = batch.response_mask.bool()
    replay = RoutingReplay(hf, replay=True)
    try:
        with torch.no_grad(), replay.use(batch.routed_experts, batch.routing_mask):
            lp = _logprobs(hf, batch)
        assert (lp - batch.rollout_logprobs)[mask].abs().max().item() <= 1e-5
        assert replay.mismatch_rate() == 0.0  # fp32 on one CPU: the same top-k everywhere
        # routes that disagree everywhere (ids shifted by one expert): replay must follow them
        shifted = (batch.routed_experts.long() + 1) % hf.config.num_experts
        with torch.no_grad(), replay.use(shifted.to(torch.int16), batch.routing_mask):
            forced = _logprobs(hf, batch)
        assert replay.mismatch_rate() == 1.0
        assert (forced - lp)[mask].abs().max().item() > 1e-3
    finally:
        replay.remove()
    measure = RoutingReplay(hf, replay=False)  # replay off: the native forward, mismatch counted
    try:
        with torch.no_grad(), measure.use(shifted.to(torch.int16), batch.routing_mask):
            native = _logprobs(hf, batch)
        assert measure.mismatch_rate() == 1.0
        assert (native - lp)[mask].abs().max().item() <= 1e-5
    finally:
        measure.remove()


def test_actor_replays_and_reports_the_mismatch(rollout):
    """``actor.routing_replay: true``: the actor's recomputed log-probs are the engine's, and its
    update reports ``actor/routing_mismatch``."""
    from asyncrl.config import ActorConfig, AlgorithmConfig
    from asyncrl.training.actor import Actor

    hf, batch = rollout
    actor = Actor(hf, ActorConfig(routing_replay=True, lr=1e-9), AlgorithmConfig(), temperature=1.0)
    try:
        lp = actor.compute_logprobs(batch)
        assert (lp - batch.rollout_logprobs)[batch.response_mask.bool()].abs().max().item() <= 1e-5
        batch.advantages = torch.zeros_like(batch.response_mask)
        assert actor.update(batch)["actor/routing_mismatch"] == 0.0
    finally:
        actor.routing.remove()


def test_replayed_weights_keep_router_gradients(rollout):
    """Replay swaps the indices but recomputes the weights from the live softmax: the router
    weights still get a gradient."""
    hf, batch = rollout
    replay = RoutingReplay(hf, replay=True)
    try:
        hf.zero_grad()
        with replay.use(batch.routed_experts, batch.routing_mask):
            lp = _logprobs(hf, batch)
        (lp * batch.response_mask).sum().backward()
        grads = [r.weight.grad for r in find_routers(hf)]
        assert all(g is not None and g.abs().sum() > 0 for g in grads)
    finally:
        replay.remove()
        hf.zero_grad()


def test_activation_checkpointing_recomputes_with_the_replayed_routes(rollout):
    """A layer recomputed in backward (activation checkpointing) runs after ``use`` has ended: it
    must replay the same routes (natively routed experts have the same shapes, so torch's
    checkpoint check cannot see the difference: only the gradients would be wrong), and the
    recomputation does not count the mismatch twice."""
    import copy

    from asyncrl.training.recompute import enable_activation_checkpointing

    hf, batch = rollout
    shifted = ((batch.routed_experts.long() + 1) % hf.config.num_experts).to(torch.int16)  # differ from native
    grads, rates = [], []
    for checkpointed in (False, True):
        model = copy.deepcopy(hf).train()
        if checkpointed:
            enable_activation_checkpointing(model)
        replay = RoutingReplay(model, replay=True)
        try:
            with replay.use(shifted, batch.routing_mask):
                lp = _logprobs(model, batch)
            (lp * batch.response_mask).sum().backward()
            rates.append((replay.differ, replay.compared))
        finally:
            replay.remove()
        grads.append([p.grad for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert rates[0] == rates[1]
