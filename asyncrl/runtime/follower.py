"""What a rank other than 0 does in ``asyncrl train`` under fsdp2: hold its shard of every
role and replay rank 0's calls (distributed/lockstep.py) until rank 0 finishes.

Rank 0 drives the session in this order, and a follower mirrors it:
    session.open_run(run_dir)     the run directory rank 0 created: open this rank's log
    session.build(model_path)     the policy rank 0 prepared (warm start included): build it on
                                  the meta device, shard every role (weights from rank 0)
    actor.update(batch), weights.push(version), checkpoint.write(dir), memory.gather_step() ...
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from asyncrl.distributed.group import DataParallel
from asyncrl.distributed.lockstep import serve
from asyncrl.metrics.memory import MemoryTracker
from asyncrl.runtime.publisher import WeightPublisher
from asyncrl.runtime.rank_log import open_rank_log
from asyncrl.runtime.rank_memory import RankMemory
from asyncrl.runtime.roles import DTYPES, build_roles
from asyncrl.runtime.sharded_checkpoint import ShardedCheckpointer
from asyncrl.training.lora import apply_lora


def meta_policy(path: str, dtype: str) -> torch.nn.Module:
    """The architecture of the checkpoint at ``path`` with no weights (meta tensors): the
    shards are filled from rank 0's copy when the roles are sharded."""
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])


class FollowerSession:
    """The ``session`` role: sets up this rank when rank 0 says so (see module doc)."""

    def __init__(self, cfg, dp: DataParallel, roles: dict):
        self.cfg, self.dp, self.roles = cfg, dp, roles
        self.memory = RankMemory(dp, MemoryTracker(str(dp.device), enabled=cfg.logging.memory))
        roles["memory"] = self.memory

    def open_run(self, run_dir: str) -> None:
        open_rank_log(Path(run_dir), self.dp.rank)

    def build(self, model_path: str) -> None:
        cfg = self.cfg
        policy = meta_policy(model_path, cfg.model.dtype)
        if cfg.actor.lora.enabled:  # the same PEFT wrapper as rank 0's (pipeline.py), on meta tensors
            policy = apply_lora(policy, cfg.actor.lora)
        actor, reference, critic = build_roles(cfg, policy, self.dp)
        dtype, lora = DTYPES[cfg.model.dtype], cfg.actor.lora
        self.roles.update(actor=actor, reference=reference, critic=critic,
                          weights=WeightPublisher(actor, None, cfg.rollout.weight_sync_bucket_mb, dtype,
                                                  merged_lora=lora.enabled and lora.merged_rollout),
                          checkpoint=ShardedCheckpointer(actor, None, dtype, lora.enabled and lora.save_merged))


def follow_training(cfg, dp: DataParallel) -> dict:
    """Serve rank 0 until it finishes the job; a follower has no summary of its own."""
    roles: dict = {}
    session = FollowerSession(cfg, dp, roles)
    roles["session"] = session
    serve(dp, roles, around=session.memory.stage)
    return {}
