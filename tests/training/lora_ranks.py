"""What tests/training/test_lora_sharded.py runs on 2 gloo ranks and in one process: a LoRA
policy (PEFT, rank 4 on the seven linears of cases.tiny_model, adapters randomized so that B is
not zero) trained 3 steps with a KL term (the reference = the base with adapters off), its push
(adapters, and merged weights) and a sharded checkpoint written after step 2 and resumed for
step 3. Every value is gathered to full tensors for comparison."""
from __future__ import annotations

from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.distributed.group import SINGLE, init_distributed
from asyncrl.runtime.roles import build_roles
from asyncrl.training.lora import adapter_tensors, apply_lora
from tests.distributed import cases

LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "algorithm.kl_coef=0.1", "actor.micro_batch_size=2"]
STEPS, CHECKPOINT_AFTER = 3, 2
PROBE_PROMPT = [3, 5, 7, 2]


class RecordingBackend(cases.RecordingBackend):
    """Keeps what it was sent; ``merged_lora`` as an engine serving merged weights says."""

    def __init__(self, merged_lora: bool = False):
        super().__init__()
        self.merged_lora = merged_lora


def lora_policy(cfg, meta: bool = False) -> torch.nn.Module:
    """cases.tiny_model with adapters; off meta, A and B drawn from a fixed generator (B != 0)."""
    policy = apply_lora(cases.tiny_model(meta), cfg.actor.lora)
    if not meta:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for _, param in adapter_tensors(policy):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return policy


def build(sharded: bool, meta: bool = False, engine: bool = False):
    """(actor, reference, the policy before sharding's engine or None); ``engine``: rank 0 (or
    the one process) serves the policy in an asyncrl engine built before the shards are cut."""
    cfg = load_config(None, [*LORA, f"trainer.strategy={'fsdp2' if sharded else 'single'}", "trainer.device=cpu"])
    dp = init_distributed(cfg.trainer) if sharded else SINGLE
    policy = lora_policy(cfg, meta)
    backend = None
    if engine and dp.is_main:
        from asyncrl.rollout.engine_backend import EngineBackend
        backend = EngineBackend(policy, None, dtype=torch.float32, device="cpu", num_kv_blocks=16, block_size=8)
    actor, reference, _ = build_roles(cfg, policy, dp)
    return actor, reference, backend


def step(actor, reference, index: int) -> dict:
    """Step ``index``: log-probs, reference log-probs (adapters off), one update."""
    batch = cases.make_batch("uneven", seed=3 + index)
    logprobs = actor.compute_logprobs(batch)
    wave = torch.sin(torch.arange(logprobs.numel()).view_as(logprobs))
    batch.old_logprobs = logprobs + 0.3 * wave * batch.response_mask
    batch.ref_logprobs = reference.compute_logprobs(batch)
    return {"logprobs": logprobs, "ref_logprobs": batch.ref_logprobs.clone(), "metrics": actor.update(batch)}


def named(actor, trainable: bool) -> dict[str, torch.Tensor]:
    """Full tensors of the adapters (``trainable``) or of the frozen base (a collective)."""
    return {name.removeprefix("policy."): cases._full(p).detach().clone()
            for name, p in actor.forward_module.named_parameters() if p.requires_grad == trainable}


def pushed(actor, merged: bool, sharded: bool) -> dict[str, torch.Tensor]:
    """What a push hands a backend (rank 0's; {} on the others)."""
    from asyncrl.runtime.publisher import WeightPublisher

    backend = RecordingBackend(merged) if actor.dp.is_main else None
    WeightPublisher(actor, backend, 1, torch.float32, merged_lora=merged and sharded).push(actor.version)
    return backend.tensors if backend is not None else {}


def probe(actor, backend) -> dict:
    """The engine's log-probs of a few sampled tokens (rank 0) and the trainer's of the same
    tokens (every rank computes them: the token ids are broadcast from rank 0)."""
    from asyncrl.types import SamplingParams, TrainBatch

    tokens = [None]
    if backend is not None:
        params = SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=0, logprobs=True, ignore_eos=True)
        completion = backend.generate([PROBE_PROMPT], params)[0].completions[0]
        tokens = [(list(completion.token_ids), list(completion.logprobs), list(completion.versions))]
    if actor.dp.sharded:
        torch.distributed.broadcast_object_list(tokens, src=0)
    ids, engine_lp, versions = tokens[0]
    n = len(ids)
    batch = TrainBatch(input_ids=torch.tensor([PROBE_PROMPT + ids]), attention_mask=torch.ones(1, 4 + n).long(),
                       response_mask=torch.ones(1, n), prompt_length=len(PROBE_PROMPT),
                       rollout_logprobs=torch.zeros(1, n), token_versions=torch.zeros(1, n).long(),
                       scores=torch.zeros(1), group_ids=torch.zeros(1).long())
    return {"engine": torch.tensor(engine_lp), "trainer": actor.compute_logprobs(batch)[0], "versions": versions}


def run(sharded: bool, checkpoint: Path, meta: bool = False) -> dict:
    """3 steps (a checkpoint after step 2), the pushes, the engine probe; then a fresh build
    resumed from the checkpoint runs step 3 again."""
    from asyncrl.runtime.sharded_checkpoint import ShardedCheckpointer

    actor, reference, engine = build(sharded, meta, engine=True)
    base_before = named(actor, trainable=False)
    steps, saved = [], None
    for index in range(STEPS):
        if index == CHECKPOINT_AFTER and sharded:
            checkpoint.mkdir(parents=True, exist_ok=True)
            ShardedCheckpointer(actor, None, torch.float32, save_merged=True).write(str(checkpoint))
            saved = named(actor, trainable=True)
        steps.append(step(actor, reference, index))
    out = {"steps": steps, "saved_adapters": saved, "adapters": named(actor, trainable=True), "base_before": base_before,
           "base_after": named(actor, trainable=False),
           "push": pushed(actor, merged=False, sharded=sharded), "merged": pushed(actor, merged=True, sharded=sharded)}
    from asyncrl.runtime.publisher import WeightPublisher
    publisher = WeightPublisher(actor, engine, 1, torch.float32)
    publisher.push(actor.version)
    out["push_bytes"] = publisher.last_bytes
    out["probe"] = probe(actor, engine)
    if sharded:
        out["resumed"] = resume(checkpoint, sharded, meta)
    return out


def resume(checkpoint: Path, sharded: bool, meta: bool = False) -> dict:
    """A fresh policy (the same base, other adapters) loads the checkpoint written after step 2
    (at this world size) and runs step 3 again."""
    from asyncrl.runtime.sharded_checkpoint import ShardedCheckpointer

    actor, reference, _ = build(sharded, meta)
    ShardedCheckpointer(actor, None, torch.float32).load(str(checkpoint))
    return {**step(actor, reference, CHECKPOINT_AFTER), "adapters": named(actor, trainable=True)}


def uneven_gather() -> dict:
    """distributed/gather.py on shapes FSDP2 splits unevenly (5 rows on 2 ranks, 1 row: rank 1
    holds nothing) in mixed dtypes: (one flat gather, each tensor's own full_tensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from asyncrl.distributed.gather import gather_whole

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    gen = torch.Generator().manual_seed(2)
    full = [torch.randn(5, 3, generator=gen), torch.randn(1, 4, generator=gen).bfloat16(),
            torch.randn(7, generator=gen), torch.randn(2, 2, 2, generator=gen)]
    shards = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]
    return {"whole": gather_whole(shards), "each": [s.full_tensor() for s in shards], "full": full}


def rank_main(rank: int, world: int, out_dir: str, checkpoint: str) -> None:
    result = run(sharded=True, checkpoint=Path(checkpoint), meta=rank > 0)
    result["gather"] = uneven_gather()
    if rank == 0:
        torch.save(result, Path(out_dir) / "lora_world2.pt")
