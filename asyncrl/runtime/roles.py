"""The trainer's roles for the configured strategy: plain modules in one process, or each
role's model sharded with FSDP2 over the data-parallel group (docs/distributed.md).

    actor      always; trained (fp32 master shards, compute-dtype gathers)
    reference  when a KL needs it; frozen, forward only, sharded in the compute dtype
    critic     when ``critic.enable``; trained like the actor

Under fsdp2 the frozen reference and the critic's backbone are copied from the policy before
the actor's model is sharded (rank 0 holds the real weights, other ranks may hold meta
tensors: each role's shards are filled from rank 0's copy). A LoRA policy (PEFT) is sharded
whole, its frozen base included, and its reference is the actor's own sharded module with the
adapters disabled: no copy.
"""
from __future__ import annotations

from typing import Optional

import torch

from asyncrl.distributed.fsdp import shard_model
from asyncrl.distributed.group import SINGLE, DataParallel
from asyncrl.training.actor import Actor
from asyncrl.training.critic import Critic, CriticValues, build_value_model
from asyncrl.training.forward import PolicyLogprobs
from asyncrl.training.forward_plan import prepare_model
from asyncrl.training.lora import AdapterDisabledReference, is_lora
from asyncrl.training.recompute import enable_activation_checkpointing
from asyncrl.training.reference import Reference, frozen_copy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def master_dtype(cfg) -> torch.dtype:
    """The dtype of the trained shards and the optimizer state: fp32 unless
    ``actor.master_dtype`` asks for the compute dtype (pure bf16)."""
    name = getattr(cfg.actor, "master_dtype", None)
    return torch.float32 if name in (None, "auto", "float32") else DTYPES[name]


def needs_reference(algo) -> bool:
    return algo.kl_coef > 0 or algo.use_kl_in_reward


def build_roles(cfg, model, dp: DataParallel = SINGLE) -> tuple[Actor, Optional[Reference], Optional[Critic]]:
    """The trainer's roles for ``cfg``: the actor always; the frozen reference when a KL (loss
    term or in the reward) needs it; the critic when ``critic.enable``. Sharded when
    ``dp.sharded`` (a collective: every rank builds its roles together)."""
    algo, temperature, micro = cfg.algorithm, cfg.rollout.temperature, cfg.actor.micro_batch_size
    if cfg.actor.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if not dp.sharded:
        actor = Actor(model, cfg.actor, algo, temperature)
        reference_class = AdapterDisabledReference if is_lora(model) else Reference  # LoRA: the base, no copy
        reference = (reference_class(model, temperature, micro, cfg.actor.logprob_chunk_tokens)
                     if needs_reference(algo) else None)
        critic = (Critic(build_value_model(model), cfg.critic, algo.loss_agg_mode, micro, algo.loss_scale_factor,
                         cfg.actor.master_dtype) if cfg.critic.enable else None)
        return actor, reference, critic
    compute, master = DTYPES[cfg.model.dtype], master_dtype(cfg)
    offload = cfg.actor.offload == "full"
    # the forward plan for the device and dtype the shards will compute in (forward_plan.py); the
    # copies below inherit it, and FSDP2 keeps the swapped classes and compiled blocks
    plan = prepare_model(model, cfg.actor.kernels, cfg.actor.packing, cfg.actor.compile, device=dp.device,
                         dtype=compute)
    lora = is_lora(model)  # PEFT: the base shards in the compute dtype, the adapters' in the master dtype (fsdp.py)
    # copies first (rank 0's are the real ones); LoRA's reference is the actor's own base: no copy
    ref_policy = frozen_copy(model) if needs_reference(algo) and not lora else None
    value_model = build_value_model(model, dp.device, compute) if cfg.critic.enable else None
    forward = shard_model(PolicyLogprobs(model), dp, compute_dtype=compute, master_dtype=master, offload_params=offload)
    actor = Actor(model, cfg.actor, algo, temperature, forward=forward, dp=dp, plan=plan, compute_dtype=compute)
    reference = critic = None
    if lora and needs_reference(algo):
        reference = AdapterDisabledReference(model, temperature, micro, cfg.actor.logprob_chunk_tokens,
                                             forward=forward, dp=dp)
    if ref_policy is not None:
        ref_forward = shard_model(PolicyLogprobs(ref_policy), dp, compute_dtype=compute, master_dtype=compute,
                                  offload_params=offload)
        reference = Reference(None, temperature, micro, cfg.actor.logprob_chunk_tokens, forward=ref_forward, dp=dp)
    if value_model is not None:
        values = shard_model(CriticValues(value_model), dp, compute_dtype=compute, master_dtype=master,
                             offload_params=offload)
        critic = Critic(value_model, cfg.critic, algo.loss_agg_mode, micro, algo.loss_scale_factor,
                        cfg.actor.master_dtype, forward=values, dp=dp)
    return actor, reference, critic
