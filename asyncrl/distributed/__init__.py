"""Scale-out: the trainer's data-parallel group, FSDP2 sharding, sharded checkpoints, launch,
and the full-tensor weight stream to the rollout backend (docs/distributed.md)."""
from asyncrl.distributed.group import SINGLE, DataParallel, init_distributed, resolve_strategy

__all__ = ["SINGLE", "DataParallel", "init_distributed", "resolve_strategy"]
