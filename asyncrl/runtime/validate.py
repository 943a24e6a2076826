"""Checks of a loaded config against what is registered, and of combinations that cannot work.

``config`` may not import ``algorithms`` (dependency direction), so the names of
registered estimators and losses are checked here, before anything runs. Each
combination rule is one entry of ``RULES``: a predicate that is True when the config
is broken, and the message that says why and what to set instead.
"""
from __future__ import annotations

from typing import Callable, Optional

from asyncrl.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from asyncrl.config_schema import ConfigError, closest_key
from asyncrl.distributed.group import env_world_size

# What an advantage estimator reads besides scores (the controller fills these).
VALUE_ESTIMATORS = frozenset({"gae"})               # critic values [B, L]
GREEDY_BASELINE_ESTIMATORS = frozenset({"remax"})   # one greedy rollout per prompt
GROUP_ESTIMATORS_NEEDING_PAIRS = frozenset({"grpo_passk"})
ON_POLICY_LOSSES = frozenset({"pg", "gpg"})          # -A·lp: no ratio, so no use for old log-probs


def check_registered_names(cfg) -> None:
    """Refuse an unknown estimator / loss name, naming the key and the closest valid name."""
    algo = cfg.algorithm
    for key, value, registry in (("algorithm.adv_estimator", algo.adv_estimator, ADV_ESTIMATORS),
                                 ("algorithm.policy_loss", algo.policy_loss, POLICY_LOSSES),
                                 ("algorithm.kl_estimator", algo.kl_estimator, KL_ESTIMATORS),
                                 ("algorithm.kl_penalty", algo.kl_penalty, KL_ESTIMATORS)):
        names = registry.names()
        if value not in names:
            raise ConfigError(f"{key}: {value!r} is not one of {names}{closest_key(value, names)}")


def _multi_step(cfg) -> bool:
    return cfg.actor.ppo_epochs > 1 or cfg.actor.mini_batches > 1


Rule = tuple[Callable[[object], bool], Callable[[object], str]]

RULES: list[Rule] = [
    (lambda c: c.algorithm.adv_estimator in VALUE_ESTIMATORS and not c.critic.enable,
     lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} needs critic values: set critic.enable=true "
               "(and critic.lr), or pick a critic-free estimator such as grpo or rloo"),
    (lambda c: c.critic.enable and c.algorithm.adv_estimator not in VALUE_ESTIMATORS,
     lambda c: f"critic.enable=true but algorithm.adv_estimator={c.algorithm.adv_estimator} never reads values: "
               f"the critic would train for nothing; use one of {sorted(VALUE_ESTIMATORS)} or critic.enable=false"),
    (lambda c: c.algorithm.adv_estimator in GROUP_ESTIMATORS_NEEDING_PAIRS and c.rollout.n < 2,
     lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} compares the best and second-best response "
               "of a group: set rollout.n >= 2"),
    (lambda c: c.algorithm.filter_groups.enable and c.rollout.n < 2,
     lambda c: "algorithm.filter_groups drops groups whose metric is constant, and a group of rollout.n=1 is "
               "always kept: set rollout.n >= 2 or filter_groups.enable=false"),
    (lambda c: c.algorithm.decoupled and not c.algorithm.rollout_correction.enabled,
     lambda c: "algorithm.decoupled=true weights each token by π_prox/π_behav: set "
               "algorithm.rollout_correction.level (token is AReaL's choice; sequence or geometric)"),
    (lambda c: c.algorithm.policy_loss in ON_POLICY_LOSSES and _multi_step(c)
     and not c.algorithm.rollout_correction.enabled,
     lambda c: f"algorithm.policy_loss={c.algorithm.policy_loss} (−A·lp) has no ratio, so it is only correct for "
               "one optimizer step per batch: set actor.ppo_epochs=1 and actor.mini_batches=1, or use ppo_clip"),
    (lambda c: c.algorithm.kl_ctrl.type == "adaptive" and not c.algorithm.use_kl_in_reward,
     lambda c: "algorithm.kl_ctrl drives the β of the KL in the reward: set algorithm.use_kl_in_reward=true "
               "(the KL loss term uses the fixed algorithm.kl_coef)"),
    (lambda c: (c.rollout.quantization != "none" or c.rollout.kv_cache_dtype != "auto")
     and not c.algorithm.rollout_correction.enabled,
     lambda c: "rollout.quantization / rollout.kv_cache_dtype = fp8 samples from a quantized copy of the policy, whose "
               "log-probs differ from the trainer's: set algorithm.rollout_correction.level=token (truncated "
               "importance sampling; verl's FP8 rollout needs it to match bf16 accuracy)"),
    (lambda c: c.rollout.fp8_scaling != "block" and c.rollout.quantization != "fp8",
     lambda c: f"rollout.fp8_scaling={c.rollout.fp8_scaling} scales FP8 weights, but rollout.quantization="
               f"{c.rollout.quantization} keeps them unquantized: set rollout.quantization=fp8 or drop fp8_scaling"),
    (lambda c: c.critic.freeze_actor_steps > 0 and not c.critic.enable,
     lambda c: "critic.freeze_actor_steps trains only the critic for the first steps: it needs critic.enable=true"),
    # -- the async runtime (docs/async.md) --
    (lambda c: _async(c) and c.runtime.max_staleness > 0 and not _corrected(c),
     lambda c: f"runtime.mode=async with runtime.max_staleness={c.runtime.max_staleness} trains on tokens sampled by "
               "policies up to that many versions old, and plain PPO then clips around the stale behaviour policy "
               "(NeMo RL saw collapse without a correction): set algorithm.decoupled=true and "
               "algorithm.rollout_correction.level=token (decoupled PPO), or runtime.max_staleness=0"),
    (lambda c: _async(c) and c.runtime.sync_every - 1 > c.runtime.max_staleness,
     lambda c: f"runtime.sync_every={c.runtime.sync_every} leaves the rollout weights up to {c.runtime.sync_every - 1} "
               f"versions behind, beyond runtime.max_staleness={c.runtime.max_staleness}: admission would stop and "
               "the run would deadlock; set max_staleness >= sync_every - 1"),
    (lambda c: _async(c) and c.algorithm.filter_groups.enable,
     lambda c: "algorithm.filter_groups (DAPO dynamic sampling) is not implemented in runtime.mode=async: use sync"),
    (lambda c: _async(c) and c.algorithm.adv_estimator in GREEDY_BASELINE_ESTIMATORS,
     lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} needs a greedy rollout per prompt, which "
               "runtime.mode=async does not generate: use sync"),
    (lambda c: _async(c) and c.critic.freeze_actor_steps > 0,
     lambda c: "critic.freeze_actor_steps keeps the policy version still, so async admission would stop: use sync"),
    (lambda c: c.runtime.rollout_device is not None and not _rollout_process(c) and not _ray_fleet(c),
     lambda c: f"runtime.rollout_device={c.runtime.rollout_device} places the rollout process: it needs "
               "runtime.mode=async, runtime.executor=local and runtime.rollout_process=true"),
    (lambda c: _ray_fleet(c) and ":" in (c.runtime.rollout_device or ""),
     lambda c: f"runtime.rollout_device={c.runtime.rollout_device}: with runtime.executor=ray, Ray places the "
               "replicas on the cluster's GPUs; give the kind only (cuda or cpu)"),
    (lambda c: c.runtime.weight_transport != "shared" and not _rollout_process(c),
     lambda c: f"runtime.weight_transport={c.runtime.weight_transport} moves weights to the rollout process: it "
               "needs runtime.mode=async, runtime.executor=local and runtime.rollout_process=true"),
    (lambda c: c.actor.master_dtype not in ("float32", c.model.dtype),
     lambda c: f"actor.master_dtype={c.actor.master_dtype} with model.dtype={c.model.dtype}: the master weights are "
               "float32 or the model's own dtype (pure low-precision training)"),
    # -- the fleet beside workflows / servers (checked first: their own rules would name rollout_process) --
    (lambda c: _fleet(c) and c.workflow.enabled,
     lambda c: "workflow.fn runs its episodes on one in-process engine; a rollout fleet (rollout.engines > 1 or "
               "rollout.tensor_parallel_size > 1) does not serve workflows yet: set both to 1"),
    (lambda c: _fleet(c) and c.rollout.backend == "openai",
     lambda c: "rollout.backend=openai generates on its server: rollout.engines and rollout.tensor_parallel_size "
               "belong to that server (`asyncrl serve`), set both to 1 here"),
    # -- workflows and remote servers (docs/workflows.md) --
    (lambda c: c.workflow.enabled and c.rollout.backend == "hf",
     lambda c: "workflow.fn runs episodes on the asyncrl engine or an OpenAI-compatible server: set rollout.backend "
               "to auto, engine or openai"),
    (lambda c: c.workflow.enabled and (_rollout_process(c) or c.runtime.executor == "ray"),
     lambda c: "workflow.fn runs its episodes in the trainer's process (an engine thread): set "
               "runtime.rollout_process=false and runtime.executor=local"),
    (lambda c: c.rollout.backend == "openai" and not c.rollout.openai.base_url,
     lambda c: "rollout.backend=openai needs rollout.openai.base_url (e.g. http://127.0.0.1:8000 from "
               "`asyncrl serve MODEL`)"),
    (lambda c: c.rollout.backend == "openai" and (_rollout_process(c) or c.runtime.executor == "ray"),
     lambda c: "rollout.backend=openai already generates in another process (the server): set "
               "runtime.rollout_process=false and runtime.executor=local"),
    (lambda c: c.task.name == "calculator" and not c.workflow.enabled and not c.data.enabled,
     lambda c: "task.name=calculator is a tool-use task: set workflow.fn=calculator (recipes/calculator_tool.yaml)"),
    # -- the sharded trainer (docs/distributed.md) --
    (lambda c: _sharded(c) and _async(c),
     lambda c: "trainer.strategy=fsdp2 / trainer.gpus > 1 (the sharded trainer) runs runtime.mode=sync; the async "
               "runtime with a sharded trainer is not implemented yet: set runtime.mode=sync, or trainer.gpus=1"),
    (lambda c: c.actor.offload == "full" and not _sharded(c) and env_world_size() == 1,
     lambda c: "actor.offload=full keeps FSDP2's shards in host memory: it needs trainer.strategy=fsdp2 (any "
               "number of ranks, 1 included); with one process use actor.offload=optimizer"),
    (lambda c: c.runtime.executor == "ray" and not _async(c) and c.trainer.gpus == 1,
     lambda c: "runtime.executor=ray runs the async rollout side in Ray actors (set runtime.mode=async), or the "
               "trainer's ranks as Ray actors (set trainer.gpus=N)"),
    # -- the rollout fleet (docs/fleet.md) --
    (lambda c: _fleet(c) and not _async(c),
     lambda c: f"rollout.engines={c.rollout.engines} x rollout.tensor_parallel_size={c.rollout.tensor_parallel_size} "
               "runs engine replicas beside the trainer: set runtime.mode=async"),
    (lambda c: c.rollout.tensor_parallel_size > 1 and c.rollout.backend == "hf",
     lambda c: "rollout.tensor_parallel_size > 1 splits the asyncrl engine's model: set rollout.backend=engine"),
    (lambda c: c.rollout.tensor_parallel_size > 1 and c.rollout.speculative.method != "off",
     lambda c: f"rollout.speculative.method={c.rollout.speculative.method} with rollout.tensor_parallel_size="
               f"{c.rollout.tensor_parallel_size}: speculative decoding runs at tensor_parallel_size=1 only (its "
               "verify step is not split over ranks yet); set one of them off (rollout.engines > 1 keeps "
               "speculation on every replica)"),
    (lambda c: c.actor.lora.enabled and c.actor.lora.merged_rollout and (_fleet(c) or c.runtime.executor == "ray"),
     lambda c: "actor.lora.merged_rollout=true with a rollout fleet or Ray replicas: the replicas serve the adapter "
               "unmerged (merged serving is built for one engine); set actor.lora.merged_rollout=false, or "
               "rollout.engines=1, rollout.tensor_parallel_size=1 and runtime.executor=local"),
]


def _async(c) -> bool:
    return c.runtime.mode == "async"


def _sharded(c) -> bool:
    return c.trainer.strategy == "fsdp2" or c.trainer.gpus > 1


def _rollout_process(c) -> bool:
    """The rollout backend runs in its own process(es) (async, local executor; a fleet always)."""
    return _async(c) and (c.runtime.rollout_process or _fleet(c)) and c.runtime.executor == "local"


def _fleet(c) -> bool:
    """Several engine replicas, or one split over TP ranks (``rollout/fleet.py``)."""
    return c.rollout.engines > 1 or c.rollout.tensor_parallel_size > 1


def _ray_fleet(c) -> bool:
    """A fleet whose replicas are Ray actors (``executors/ray_replicas.py``)."""
    return _async(c) and _fleet(c) and c.runtime.executor == "ray"


def check_fleet_devices(cfg, visible_gpus: Optional[int] = None) -> None:
    """Replicas × TP ranks fit the visible GPUs from the rollout device, or the Ray cluster's
    GPUs (joined or started here) with ``runtime.executor=ray``: before anything loads."""
    if not (_fleet(cfg) and _async(cfg)):
        return
    from asyncrl.runtime.executors.replicas import FleetConfigError, fleet_devices

    try:
        if cfg.runtime.executor == "ray":
            from asyncrl.runtime.executors.ray_cluster import check_cluster_gpus, init_ray_for, replicas_on_gpu

            if replicas_on_gpu(cfg):
                init_ray_for(cfg)
                check_cluster_gpus(cfg.rollout.engines, cfg.rollout.tensor_parallel_size)
            return
        fleet_devices(_resolved(cfg.runtime.rollout_device or cfg.trainer.device), cfg.rollout.engines,
                      cfg.rollout.tensor_parallel_size, visible_gpus)
    except FleetConfigError as err:
        raise ConfigError(str(err)) from None


def _resolved(device: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def _corrected(c) -> bool:
    """An off-policy correction the actor applies: decoupled PPO or truncated IS (both recompute
    π_prox and weight by π_prox/π_behav)."""
    return c.algorithm.decoupled or c.algorithm.rollout_correction.enabled


def check_combinations(cfg) -> None:
    """Refuse the first combination of settings that cannot work, saying why."""
    for broken, message in RULES:
        if broken(cfg):
            raise ConfigError(message(cfg))


def validate_config(cfg) -> None:
    """Every run-time check: registered names, combinations, then the fleet's GPUs."""
    check_registered_names(cfg)
    check_combinations(cfg)
    check_fleet_devices(cfg)
