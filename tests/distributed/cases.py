"""The data-parallel cases the multi-rank tests run: a tiny Qwen3, batches whose groups have
unequal response lengths (so the token-balanced split is uneven), and one training step per
case, returned as plain tensors (loss, every gradient and weight, gathered) for comparison with
the single-process run of the same step."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncrl.config import load_config
from asyncrl.distributed.group import SINGLE, init_distributed
from asyncrl.runtime.roles import build_roles
from asyncrl.types import TrainBatch

VOCAB, PROMPT, RESPONSE = 16, 4, 6

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LOSS_TERMS = ["algorithm.kl_coef=0.1", "algorithm.entropy_coeff=0.01", "actor.micro_batch_size=2"]
CASES = {
    **{mode: ([f"algorithm.loss_agg_mode={mode}", *LOSS_TERMS], "uneven") for mode in AGG_MODES},
    # two optimizer steps whose mini-batch boundary cuts a group, one micro-batch per row
    "mini_batches": (["actor.mini_batches=2", "actor.micro_batch_size=1"], "uneven"),
    # one rank's share holds only empty responses (not a single valid token)
    "empty_rank": (["actor.micro_batch_size=2"], "empty_rank"),
    # fewer groups than ranks at N=4: a rank has no row at all
    "few_groups": (["actor.micro_batch_size=2"], "few_groups"),
    "checkpointing": (["actor.gradient_checkpointing=true", "actor.micro_batch_size=4"], "uneven"),
    "offload_full": (["actor.offload=full", "actor.micro_batch_size=4"], "uneven"),
    "offload_optimizer": (["actor.offload=optimizer", "actor.micro_batch_size=4"], "uneven"),
    "critic": (["critic.enable=true", "algorithm.adv_estimator=gae", "actor.micro_batch_size=2"], "uneven"),
}


ADAM_EPS, LR = 1e-8, 1e-4  # torch's AdamW eps; actor.lr of every case
INSENSITIVE_GRAD = 100 * ADAM_EPS


def assert_weights_close(got: dict, want: dict, grads: dict, what: str, tol: float = 1e-6):
    """Updated weights equal to 1e-6 wherever the step's gradient is above 100·ε of Adam. Below
    it, Adam's first step lr·g/(|g| + ε) amplifies the gradient's float noise by up to lr/ε = 1e4
    (measured: g = −5.01e-9 in one process, −5.26e-9 on 2 ranks -> weights 1.1e-6 apart), so
    there both runs' updates are noise, bounded by a few steps of size lr (Adam moves a weight by
    at most ~lr·(1 − β1)/√(1 − β2) ≈ 3.2·lr per step)."""
    assert got.keys() == want.keys(), what
    for name in want:
        diff = (got[name] - want[name]).abs()
        settled = grads[name].abs() >= INSENSITIVE_GRAD if name in grads else torch.ones_like(diff, dtype=torch.bool)
        if settled.any():
            assert diff[settled].max().item() <= tol * max(1.0, want[name].abs().max().item()), f"{what} {name}"
        assert diff.max().item() <= 4 * LR, f"{what} {name}: max |diff| {diff.max().item():.2e}"


def tiny_model(meta: bool = False) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                         max_position_embeddings=64)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return Qwen3ForCausalLM(config)
    return Qwen3ForCausalLM(config)


def make_batch(kind: str, seed: int = 3) -> TrainBatch:
    """Groups of 3 rows; prompts left-padded to different lengths; responses of 0..RESPONSE tokens."""
    gen = torch.Generator().manual_seed(seed)
    groups = {"uneven": 5, "empty_rank": 2, "few_groups": 3}[kind]
    rows = 3 * groups
    group_ids = torch.arange(groups).repeat_interleave(3)
    prompt_lens = torch.randint(2, PROMPT + 1, (groups,), generator=gen)[group_ids]
    resp_lens = torch.randint(0, RESPONSE + 1, (rows,), generator=gen)
    if kind == "uneven":
        resp_lens[:3] = RESPONSE  # a long first group: the token-balanced split is uneven in rows
    if kind == "empty_rank":
        resp_lens[:3] = 0  # group 0 has no valid token; it is the first rank's whole share
        resp_lens[3:] = RESPONSE
    prompts = torch.randint(1, VOCAB, (groups, PROMPT), generator=gen)[group_ids]
    ids = torch.cat([prompts, torch.randint(1, VOCAB, (rows, RESPONSE), generator=gen)], 1)
    pos = torch.arange(PROMPT + RESPONSE)
    attn = ((pos[None] >= PROMPT - prompt_lens[:, None]) & (pos[None] < PROMPT + resp_lens[:, None])).long()
    resp = (torch.arange(RESPONSE)[None] < resp_lens[:, None]).float()
    scores = torch.randn(rows, generator=gen)
    return TrainBatch(input_ids=ids * attn, attention_mask=attn, response_mask=resp, prompt_length=PROMPT,
                      rollout_logprobs=torch.zeros(rows, RESPONSE), token_versions=torch.zeros(rows, RESPONSE).long(),
                      scores=scores, group_ids=group_ids,
                      advantages=torch.randn(rows, RESPONSE, generator=gen) * resp,
                      returns=torch.randn(rows, RESPONSE, generator=gen) * resp)


def build(overrides: list[str], sharded: bool, meta: bool = False):
    strategy = "fsdp2" if sharded else "single"
    cfg = load_config(None, [*overrides, f"trainer.strategy={strategy}", "trainer.device=cpu"])
    dp = init_distributed(cfg.trainer) if sharded else SINGLE
    return cfg, build_roles(cfg, tiny_model(meta), dp)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def _named(module: torch.nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in module.named_parameters():
        value = param.grad if grads else param
        if value is not None:
            out[name.removeprefix("policy.")] = _full(value).detach().clone()
    return out


def run_case(name: str, sharded: bool, meta: bool = False) -> dict:
    """One step of case ``name``: roles built, old/ref log-probs (and values) computed, one
    update; every value gathered to full tensors (a collective when sharded)."""
    overrides, kind = CASES[name]
    cfg, (actor, reference, critic) = build(overrides, sharded, meta)
    batch = make_batch(kind)
    logprobs = actor.compute_logprobs(batch)
    batch.old_logprobs = logprobs + 0.3 * torch.sin(torch.arange(logprobs.numel()).view_as(logprobs)) * batch.response_mask
    out = {}
    if reference is not None:  # equal to the policy at step 1: moved so that the KL term is not 0
        out["ref_logprobs"] = reference.compute_logprobs(batch)
        wave = torch.cos(torch.arange(logprobs.numel()).view_as(logprobs))
        batch.ref_logprobs = out["ref_logprobs"] + 0.2 * wave * batch.response_mask
    out.update({"logprobs": logprobs.clone(), "metrics": actor.update(batch),
                "grads": _named(actor.forward_module, grads=True), "weights": _named(actor.forward_module, grads=False)})
    if critic is not None:
        batch.values = critic.compute_values(batch)
        out["values"] = batch.values.clone()
        out["critic"] = critic.update(batch)
        out["critic_weights"] = _named(critic.model, grads=False)
        out["critic_grads"] = _named(critic.model, grads=True)
    return out


def resume_batch() -> TrainBatch:
    batch = make_batch("uneven", seed=11)
    return replace(batch, advantages=batch.advantages.flip(0) * batch.response_mask)


def resume_step(actor) -> dict:
    metrics = actor.update(resume_batch())
    return {"metrics": metrics, "weights": _named(actor.forward_module, grads=False),
            "grads": _named(actor.forward_module, grads=True)}


def write_checkpoint(directory: Path) -> dict:
    """World 2: one step, a sharded checkpoint + HF export, then the next step (uninterrupted)."""
    from asyncrl.distributed import checkpoint as sharded

    cfg, (actor, _, _) = build(["actor.micro_batch_size=4"], sharded=True)
    actor.update(make_batch("uneven"))
    directory.mkdir(parents=True, exist_ok=True)
    sharded.save(directory, actor.forward_module, actor.optimizer, actor.scheduler, actor.dp)
    sharded.export_hf(directory, actor.forward_module, actor.model, actor.dp, torch.float32)
    saved = _named(actor.forward_module, grads=False)
    return {"saved_weights": saved, **resume_step(actor)}


def resume_checkpoint(directory: Path, sharded_run: bool) -> dict:
    from asyncrl.distributed import checkpoint as sharded

    cfg, (actor, _, _) = build(["actor.micro_batch_size=4"], sharded=sharded_run)
    sharded.load(directory, actor.forward_module, actor.optimizer, actor.scheduler, actor.dp)
    return resume_step(actor)


class RecordingBackend:
    """A rollout backend that keeps what it was sent."""

    def __init__(self):
        self.tensors, self.version = {}, None

    def update_weights(self, named_tensors, version: int) -> None:
        self.tensors = {name: tensor.clone() for name, tensor in named_tensors}
        self.version = version


def weight_stream(bucket_bytes: int) -> dict:
    """The sharded actor's weights through the bucketed stream and through the publisher, whose
    backend (rank 0 only) must receive every tensor; the other ranks drain the stream."""
    from asyncrl.distributed.weights import full_tensors
    from asyncrl.runtime.publisher import WeightPublisher

    _, (actor, _, _) = build(["actor.micro_batch_size=4"], sharded=True)
    actor.update(make_batch("uneven"))
    streamed = [(name, tensor.clone()) for name, tensor in full_tensors(actor.forward_module, bucket_bytes, "policy.")]
    backend = RecordingBackend() if actor.dp.is_main else None
    WeightPublisher(actor, backend, 1, torch.float32).push(7)
    return {"order": actor.dp.gather_objects([name for name, _ in streamed]), "streamed": dict(streamed),
            "weights": _named(actor.forward_module, grads=False),
            "published": backend.tensors if backend else None, "version": backend.version if backend else None}


# N = 4 runs the cases whose split differs most from N = 2; the options (checkpointing, offload,
# critic) are covered at N = 2 (a 2-core CI machine pays for every rank)
FOUR_RANK_CASES = (*AGG_MODES, "mini_batches", "empty_rank", "few_groups")


def rank_main(rank: int, world: int, out_dir: str, checkpoint: str, resume: bool) -> None:
    """Every case at this world size (the followers build on meta: rank 0's weights are broadcast)."""
    names = FOUR_RANK_CASES if world > 2 else CASES
    results = {name: run_case(name, sharded=True, meta=rank > 0) for name in names}
    results["stream"] = weight_stream(bucket_bytes=4096)
    if resume:
        results["resume"] = resume_checkpoint(Path(checkpoint), sharded_run=True)
    else:
        results["checkpoint"] = write_checkpoint(Path(checkpoint))
    if rank == 0:
        torch.save(results, Path(out_dir) / f"world{world}.pt")
