"""The actor: the policy being optimised (one role per class; see critic.py, reference.py)."""
from __future__ import annotations

import math
import time
from typing import Mapping, Optional

import torch
from torch.profiler import record_function

from asyncrl.algorithms import (LazyMetrics, PolicyLossConfig, PolicyLossInput, agg_loss, compute_policy_loss,
                                global_counts, kl_penalty, rollout_is_weights)
from asyncrl.distributed.batches import map_rows, micro_batches
from asyncrl.distributed.grad_norm import clip_grad_norm
from asyncrl.distributed.group import SINGLE, DataParallel
from asyncrl.distributed.lockstep import replicated
from asyncrl.training.compile import compile_stats
from asyncrl.training.forward import PolicyLogprobs
from asyncrl.training.forward_plan import ForwardPlan, prepare_model
from asyncrl.training.logprob_gap import LogprobGap, gap_metrics
from asyncrl.training.mfu import matmul_params, peak_flops, update_flops
from asyncrl.training.mixed_precision import trainer_adamw, trained_parameters
from asyncrl.training.optim import build_optimizer
from asyncrl.training.param_check import check_parameters_finite
from asyncrl.training.routing_replay import RoutingReplay, find_routers
from asyncrl.types import TrainBatch

# metrics that are each micro-batch's share of the mini-batch loss: they add up to it
LOSS_SHARES = ("actor/pg_loss", "actor/kl_loss")
# internal metric: how many micro-batches (over all ranks) had a non-finite loss; never returned
NONFINITE_MICROS = "actor/_nonfinite_micros"


def policy_loss_config(algo) -> PolicyLossConfig:
    """The algorithms package's loss config from an ``AlgorithmConfig``."""
    return PolicyLossConfig(
        clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
        clip_ratio_c=algo.clip_ratio_c, tau_pos=algo.tau_pos, tau_neg=algo.tau_neg,
        loss_agg_mode=algo.loss_agg_mode, loss_scale_factor=algo.loss_scale_factor)


def behaviour_weights(algo, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                      mask: torch.Tensor) -> tuple[torch.Tensor, Mapping[str, float]]:
    """Detached w = π_old/π_rollout ``[b, L]`` per ``algo.rollout_correction`` (rows must be whole:
    the sequence levels reduce over each row). Used by TIS and by decoupled PPO alike."""
    corr = algo.rollout_correction
    return rollout_is_weights(old_logprobs, rollout_logprobs, mask, level=corr.level, threshold=corr.threshold,
                              mode=corr.mode, lower_threshold=corr.lower_threshold)


def needs_recomputed_old_logprobs(actor_cfg, algo) -> bool:
    """True when the old log-probs must be computed before the update: several optimizer steps
    per batch (PPO ratio), or KL in the reward (β·KL(old‖ref) enters the advantages before any
    update).

    Not for a behaviour-weight correction (TIS) or decoupled PPO alone, at any staleness:
    π_prox is *defined* as the trainer's weights before this update, and with one optimizer
    step per batch every forward of the update runs exactly those weights, so the update's own
    forward, detached, is lp_prox (r = π_θ/π_prox = 1 at the step, w = π_prox/π_behav from the
    same values). A separate recompute would give the same numbers (up to summation order) for
    one more forward pass. Assumes the train-mode forward equals the eval-mode one (no
    dropout), as the on-policy shortcut always has."""
    return actor_cfg.ppo_epochs > 1 or actor_cfg.mini_batches > 1 or algo.use_kl_in_reward


class Actor:
    """Policy model + AdamW; computes log-probs and runs PPO-style updates.

    Invariant: one ``update`` call performs ``ppo_epochs * mini_batches`` optimizer
    steps, and within each, micro-batch losses are aggregated with the mini-batch's
    global token / sequence counts, so they sum to exactly the full mini-batch loss, over
    micro-batches and over data-parallel ranks alike (``dp``: each rank holds the whole
    batch, computes its share of whole groups, FSDP2 sums the gradients).

    ``model`` is the HF policy; ``forward`` the module the trainer calls (the FSDP2 root when
    sharded, see forward.py), by default a plain :class:`PolicyLogprobs` around ``model``;
    ``plan`` its forward plan when the role builder prepared it before sharding (roles.py).
    """

    def __init__(self, model, actor_cfg, algo_cfg, temperature: float, *,
                 forward: Optional[torch.nn.Module] = None, dp: DataParallel = SINGLE,
                 plan: Optional[ForwardPlan] = None, compute_dtype: Optional[torch.dtype] = None):
        self.model, self.cfg, self.algo, self.temperature = model, actor_cfg, algo_cfg, temperature
        self.forward_module = forward if forward is not None else PolicyLogprobs(model)
        self.dp = dp
        param = next(model.parameters())
        self.device = dp.device if dp.sharded else param.device
        self.compute_dtype = compute_dtype or param.dtype
        self.loss_cfg = policy_loss_config(algo_cfg)
        # LoRA: only the adapters require grad, so only they get optimizer state (the base stays frozen)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self._matmul_params = matmul_params(model)  # for MFU: fixed for the model's life
        if dp.sharded:  # FSDP2 keeps the fp32 master shards itself (roles.master_dtype); LoRA: the adapters' shards
            self.optimizer = build_optimizer([p for p in self.forward_module.parameters() if p.requires_grad],
                                             actor_cfg)
        else:  # float32 master weights beside a bf16/fp16 model unless actor.master_dtype says otherwise
            self.optimizer = trainer_adamw(self.trainable, actor_cfg.master_dtype, lr=actor_cfg.lr,
                                           betas=actor_cfg.betas, weight_decay=actor_cfg.weight_decay,
                                           host_moments=actor_cfg.offload == "optimizer")
        warmup = actor_cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.version = 0  # policy version: incremented per rollout batch consumed
        self._gap = LogprobGap()
        # MoE: hooks on the routers (replay the rollout's experts, or only count the mismatch)
        self.routing = RoutingReplay(model, replay=actor_cfg.routing_replay) if find_routers(model) else None
        # kernels, layout, compile of the forward (forward_plan.py); the reference's copy inherits it
        self.plan = plan if plan is not None else prepare_model(model, actor_cfg.kernels, actor_cfg.packing,
                                                                actor_cfg.compile)
        # train() walks the module tree (0.1 ms on the tiny CPU model, every step): skipped when
        # every module is in training mode already (compute_logprobs' eval() clears that)
        self._modules = list(self.forward_module.modules())

    @property
    def on_policy_shortcut(self) -> bool:
        """With one optimizer step per batch, old log-probs equal the current ones (detached),
        unless a correction or the KL-in-reward needs them recomputed beforehand."""
        return not needs_recomputed_old_logprobs(self.cfg, self.algo)

    @property
    def computes_entropy(self) -> bool:
        """Entropy is needed for the bonus; otherwise it is computed only as a metric, if asked."""
        return self.algo.entropy_coeff > 0 or self.algo.calculate_entropy

    @replicated("actor")
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] log-probs of the batch's responses under the current weights (every rank
        computes its share and receives the whole)."""
        self.forward_module.eval()
        logprobs = map_rows(batch, self.dp, self.cfg.micro_batch_size,
                            lambda micro: self._forward(micro, with_entropy=False)[0])
        return logprobs.to(batch.response_mask.device) * batch.response_mask  # the batch's device

    def _forward(self, batch: TrainBatch, with_entropy: bool):
        args = (batch.input_ids.to(self.device), batch.attention_mask.to(self.device), batch.prompt_length,
                self.temperature, self.cfg.logprob_chunk_tokens)
        if self.routing is None or batch.routed_experts is None:
            return self.forward_module(*args, with_entropy=with_entropy)
        with self.routing.use(batch.routed_experts, batch.routing_mask):  # routes align with the padded layout
            return self.forward_module(*args, with_entropy=with_entropy, share_prompts=False, pack_bin_tokens=0)

    @replicated("actor")
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """PPO epochs over mini-batches; returns averaged metrics of the step."""
        if not all(module.training for module in self._modules):
            self.forward_module.train()
        self._gap = LogprobGap()  # filled only by the on-policy shortcut's pre-update forward
        history: list[dict[str, float]] = []
        start = time.perf_counter()
        for _ in range(self.cfg.ppo_epochs):
            for mini in torch.arange(batch.batch_size).chunk(self.cfg.mini_batches):
                history.append(self._optimizer_step(batch.select(mini)))
        self.version += 1
        metrics = {**{k: sum(h[k] for h in history) / len(history) for k in history[0]}, **self._gap_metrics()}
        mismatch = self.routing.mismatch_rate() if self.routing is not None else None
        if mismatch is not None:
            metrics["actor/routing_mismatch"] = mismatch
        return {**metrics, **self._throughput(batch, time.perf_counter() - start)}

    def _throughput(self, batch: TrainBatch, seconds: float) -> dict[str, float]:
        """actor/tflops (model FLOPs of the update per second, mfu.py) and actor/mfu (over the
        device's peak, where known). The update ends in host reads of its metrics, so the GPU
        has finished by the time the clock stops."""
        # per device: the batch's FLOPs are spread over the data-parallel ranks
        flops = self.cfg.ppo_epochs * update_flops(self.model, batch.attention_mask.sum(-1),
                                                   matmul_weights=self._matmul_params) / self.dp.world_size
        out = {"actor/tflops": flops / max(seconds, 1e-9) / 1e12}
        if self.plan.body == "compiled":
            out.update(compile_stats())
        peak = peak_flops(self.device, self.compute_dtype, self.cfg.peak_tflops)
        if peak:
            out["actor/mfu"] = flops / max(seconds, 1e-9) / peak
        return out

    def _optimizer_step(self, mini: TrainBatch) -> dict[str, float]:
        # every rank holds the whole mini-batch (the scored batch is broadcast), so M and S,
        # the global counts of every loss aggregation, need no collective
        global_tokens, global_seqs = global_counts(mini.response_mask)
        self.optimizer.zero_grad(set_to_none=True)
        # every micro-batch's metrics stay on the device until one host read per step (below):
        # no sync between a micro-batch's forward and its backward, or between micro-batches
        micros = [(self._micro_loss(micro, global_tokens, global_seqs), rows)
                  for micro, rows in micro_batches(mini, self.dp, self.cfg.micro_batch_size)]
        with record_function("actor/clip_grad"):
            grad_norm = self._clip_gradients()
        with record_function("actor/metrics"):
            sums, grad_norm = self._sum_metrics(micros, grad_norm, mini.batch_size)
        nonfinite_micros = sums.pop(NONFINITE_MICROS, 0.0)
        # a NaN/Inf gradient would poison the weights, and so would a non-finite loss (its
        # backward ran, see _micro_loss): skip the step and count it. The norm and the summed
        # metrics are global: every rank takes the same branch
        if math.isfinite(grad_norm) and not nonfinite_micros:
            with record_function("actor/optimizer_step"):
                self.optimizer.step()
            if not self.dp.sharded:  # sharded: the global norm above is the check
                with record_function("actor/param_check"):
                    check_parameters_finite(self.model, "the actor's optimizer step", self.trainable)
            sums["actor/skipped_step"] = 0.0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            sums["actor/skipped_step"] = 1.0
        self.scheduler.step()
        sums["actor/grad_norm"] = grad_norm
        sums["actor/lr"] = self.scheduler.get_last_lr()[0]
        return sums

    def _sum_metrics(self, micros: list[tuple[LazyMetrics, int]], grad_norm: torch.Tensor,
                     batch_size: int) -> tuple[dict[str, float], float]:
        """(the step's metrics, the grad norm) from every micro-batch's device values and the
        0-d norm, read with one host sync. The metrics are weighted (LOSS_SHARES summed, the
        rest by rows / ``batch_size``) and summed over micro-batches and ranks; the internal
        NONFINITE_MICROS counts the micro-batches whose loss was not finite, over all ranks.

        A micro-batch whose loss was not finite adds no pg_loss / entropy and 1 x its weight
        to actor/nonfinite_loss (the key is there only then): the metrics it had when its
        backward was skipped."""
        parts = [metrics.stacked() for metrics, _ in micros]
        on_host = grad_norm.device.type == "cpu" and self.device.type != "cpu"  # sharded: a CPU norm
        if not on_host:
            parts.append(grad_norm.reshape(1))
        floats = torch.cat([p.to(self.device, torch.float64) for p in parts]).tolist() if parts else []
        grad_norm_value = float(grad_norm) if on_host else floats.pop()
        sums: dict[str, float] = {}
        position = 0
        for metrics, rows in micros:
            read = dict(zip(metrics, floats[position:position + len(metrics)]))
            position += len(metrics)
            nonfinite = read.pop(NONFINITE_MICROS)
            sums[NONFINITE_MICROS] = sums.get(NONFINITE_MICROS, 0.0) + nonfinite  # unweighted: padding counts
            if nonfinite:  # the metrics it had when its backward was skipped
                read.pop("actor/pg_loss", None)
                read.pop("actor/entropy", None)
                read["actor/nonfinite_loss"] = 1.0
            for key, value in read.items():
                weight = 1.0 if key in LOSS_SHARES else rows / batch_size
                sums[key] = sums.get(key, 0.0) + value * weight
        # the norm is global already (one norm over every rank's gradients)
        return self.dp.sum_metrics(sums), grad_norm_value

    def _clip_gradients(self) -> torch.Tensor:
        """The gradients' global norm before clipping, a 0-d tensor (not read here)."""
        if self.dp.sharded:
            return clip_grad_norm(self.forward_module.parameters(), self.cfg.grad_clip, self.dp)
        return torch.nn.utils.clip_grad_norm_(trained_parameters(self.optimizer), self.cfg.grad_clip)

    def _gap_metrics(self) -> dict[str, float]:
        """The logprob gap over every rank's tokens."""
        if self.dp.world_size > 1:
            parts = self.dp.gather_objects(self._gap.totals())  # floats: they travel pickled
            return gap_metrics(sum(p[0] for p in parts), sum(p[1] for p in parts), max(p[2] for p in parts))
        return self._gap.metrics()

    def _micro_loss(self, micro: TrainBatch, global_tokens: float, global_seqs: float,
                    device=None) -> LazyMetrics:
        """Forward and backward of one micro-batch; returns its metrics on the device (read by
        _sum_metrics with every other micro-batch's, once per step). NONFINITE_MICROS is 1.0
        when the loss was not finite (its pg_loss / entropy then do not count)."""
        device = device or self.device
        with record_function("actor/forward"):
            logprobs, entropy = self._forward(micro, with_entropy=self.computes_entropy)
        with record_function("actor/loss"):
            loss, out, parts = self._loss(micro, logprobs, entropy, global_tokens, global_seqs, device)
            # The loss is not read here: a host read (.item()) between the forward and the backward
            # would leave the GPU idle while the host waits. Backward always runs; a non-finite
            # loss (NaN gradients, or a wrong but finite one) is flagged on the device, and the
            # step reads the flag with the grad norm and skips the optimizer step (on every rank:
            # the flag is summed over ranks), so the NaN never reaches the weights. Every rank
            # runs every backward, as FSDP2's collectives need.
            parts.append(((NONFINITE_MICROS,), ~torch.isfinite(loss.detach())))
        with record_function("actor/backward"):
            loss.backward()
        parts.append((("actor/pg_loss",), out.loss.detach()))
        if self.computes_entropy:
            mask = micro.response_mask.to(device)
            parts.append((("actor/entropy",), (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)))
        return LazyMetrics(tuple(name for names, _ in parts for name in names),
                           torch.cat([values.reshape(-1).to(device, torch.float64) for _, values in parts]))

    def _loss(self, micro: TrainBatch, logprobs: torch.Tensor, entropy, global_tokens: float,
              global_seqs: float, device):
        """(loss, the policy loss's output, its metrics as [(names, device values [len(names)])])
        of one micro-batch."""
        mask = micro.response_mask.to(device)
        if micro.old_logprobs is not None:
            old = micro.old_logprobs.to(device)
        else:  # shortcut: one optimizer step, so this forward runs π_prox's weights (the pre-update ones)
            old = logprobs.detach()
            self._gap.add(old, micro.rollout_logprobs, mask)
        is_weights, is_metrics = None, {}
        if self.algo.rollout_correction.enabled:  # decoupled PPO / TIS: clip on π_θ/π_old, weight π_old/π_roll
            is_weights, is_metrics = behaviour_weights(self.algo, old, micro.rollout_logprobs.to(device), mask)
        out = compute_policy_loss(self.algo.policy_loss, PolicyLossInput(
            logprobs=logprobs, old_logprobs=old, advantages=micro.advantages.to(device), response_mask=mask,
            is_weights=is_weights, global_tokens=global_tokens, global_seqs=global_seqs), self.loss_cfg)
        loss = out.loss
        agg = dict(mode=self.algo.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                   norm_length=self.algo.loss_scale_factor)
        parts = [_device_values("actor/", out.metrics)]
        if is_metrics:
            parts.append(_device_values("rollout_correction/", is_metrics))
        if micro.ref_logprobs is not None and self.algo.kl_coef > 0:
            kl = agg_loss(kl_penalty(logprobs, micro.ref_logprobs.to(device), self.algo.kl_estimator), mask, **agg)
            loss = loss + self.algo.kl_coef * kl
            parts.append((("actor/kl_loss",), kl.detach()))
        if self.algo.entropy_coeff > 0:
            loss = loss - self.algo.entropy_coeff * agg_loss(entropy, mask, **agg)
        return loss, out, parts


def _device_values(prefix: str, metrics) -> tuple[tuple[str, ...], torch.Tensor]:
    """(prefixed names, values [n]) of a loss's metrics: a LazyMetrics' own device tensor (no
    sync); a plain mapping of floats (a custom loss) becomes a CPU tensor."""
    names = tuple(prefix + k for k in metrics)
    if isinstance(metrics, LazyMetrics):
        return names, metrics.stacked()
    return names, torch.tensor([float(v) for v in metrics.values()], dtype=torch.float64)
