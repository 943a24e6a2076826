"""The critic: a value model for PPO (``algorithm.adv_estimator=gae``), one role per class.

Architecture choice: transformers' ``AutoModelForTokenClassification`` with
``num_labels=1`` on the policy's config (``Qwen3ForTokenClassification`` for Qwen3),
its backbone initialised from the policy's and its scalar head zero-initialised. Why:
it is the policy architecture plus a ``Linear(hidden, 1)``, as in verl/OpenRLHF, yet a
standard HF class, so the critic saves and loads with ``save_pretrained`` /
``from_pretrained`` like any checkpoint. Zero-initialising the head makes the first
values exactly 0 (a neutral baseline) instead of noise; classifier dropout is off,
since dropout noise in V would leak into every advantage.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch
from transformers import AutoModelForTokenClassification

from asyncrl.algorithms import compute_value_loss, global_counts, masked_mean, masked_var
from asyncrl.distributed.batches import map_rows, micro_batches
from asyncrl.distributed.grad_norm import clip_grad_norm
from asyncrl.distributed.group import SINGLE, DataParallel
from asyncrl.distributed.lockstep import replicated
from asyncrl.training.forward_plan import plan_of, prepare_like
from asyncrl.training.logprobs import response_states
from asyncrl.training.mixed_precision import trainer_adamw, trained_parameters
from asyncrl.training.optim import build_optimizer
from asyncrl.training.param_check import check_parameters_finite
from asyncrl.types import TrainBatch


def build_value_model(policy, device=None, dtype=None) -> torch.nn.Module:
    """Policy architecture + scalar head; backbone weights copied from ``policy``; the policy's
    forward plan for ``device`` / ``dtype`` (default: where the policy is, forward_plan.py)."""
    config = copy.deepcopy(policy.config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    param = next(policy.parameters())
    with torch.device("meta" if param.is_meta else "cpu"):  # a meta policy (FSDP2 follower rank): a meta critic
        critic = AutoModelForTokenClassification.from_config(config)
    backbone = getattr(critic, critic.base_model_prefix)
    backbone.load_state_dict(policy.get_decoder().state_dict())
    torch.nn.init.zeros_(critic.score.weight)
    if critic.score.bias is not None:
        torch.nn.init.zeros_(critic.score.bias)
    critic = critic.to(device=param.device, dtype=param.dtype)
    prepare_like(critic, plan_of(policy), device, dtype)  # the policy's kernels, layout and compile choices
    return critic


class CriticValues(torch.nn.Module):
    """The critic's values as one module call: ``forward`` runs the backbone in the log-probs'
    layout and the scalar head. The trainer calls this wrapper (the FSDP2 root when sharded:
    its forward gathers the parameters no layer owns, the head's among them; forward.py says
    why the HF model's own forward is not the one called)."""

    def __init__(self, critic: torch.nn.Module):
        super().__init__()
        self.critic = critic

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        states, _, token_index = response_states(self.critic, input_ids, attention_mask, prompt_length)
        values = self.critic.score(states)[:, 0].float()
        rows, length = input_ids.shape[0], input_ids.shape[1] - prompt_length
        if token_index is None:
            return values.view(rows, length)
        return values.new_zeros(rows * length).index_copy(0, token_index, values).view(rows, length)


def response_values(values_module: CriticValues, batch: TrainBatch, device) -> torch.Tensor:
    """V[i, t] ``[b, L]``: the value of the state *before* response token t.

    Same alignment as the log-probs: the hidden state at position P + t − 1 predicts
    token t, so it is the state token t is chosen from (verl's ``[-L-1:-1]`` slice). Computed
    in the log-probs' layout (each prompt once per group; logprobs.response_states); positions
    past a row's response hold 0 in the packed layouts: callers mask them.
    """
    return values_module(batch.input_ids.to(device), batch.attention_mask.to(device), batch.prompt_length)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V)/Var(R) over valid tokens: 1 is a perfect critic, ≤ 0 no better than a constant.
    Constant returns leave it undefined; it is reported as 0 then (so metrics stay finite)."""
    var_returns = float(masked_var(returns, mask))
    if var_returns <= 0:
        return 0.0
    return 1.0 - float(masked_var(returns - values, mask)) / var_returns


class Critic:
    """Value model + AdamW; predicts V and fits it to the GAE returns.

    Invariant (as the actor's): one ``update`` performs ``ppo_epochs * mini_batches``
    optimizer steps, and the micro-batch losses of one step use the mini-batch's
    global token / sequence counts, so they sum to exactly the mini-batch loss.
    """

    def __init__(self, model, critic_cfg, loss_agg_mode: str, micro_batch_size: int,
                 loss_scale_factor: Optional[float] = None, master_dtype: str = "float32", *,
                 forward: Optional[CriticValues] = None, dp: DataParallel = SINGLE):
        """``loss_scale_factor``: L_norm of ``seq-mean-token-sum-norm``, the actor's
        ``algorithm.loss_scale_factor`` (verl's critic inherits it too); ``master_dtype``: the
        actor's ``actor.master_dtype`` (mixed_precision.py). Sharded (``dp.sharded``, ``forward``
        the FSDP2-wrapped values): FSDP2 keeps the master shards itself (runtime/roles.py), so the
        optimizer is the plain one over the shards."""
        self.model, self.cfg, self.loss_agg_mode, self.micro_batch_size = model, critic_cfg, loss_agg_mode, micro_batch_size
        self.loss_scale_factor = loss_scale_factor
        self.forward_module = forward if forward is not None else CriticValues(model)
        self.dp = dp
        self.device = dp.device if dp.sharded else next(model.parameters()).device
        if dp.sharded:
            self.optimizer = build_optimizer(self.forward_module.parameters(), critic_cfg)
        else:
            self.optimizer = trainer_adamw(model.parameters(), master_dtype, lr=critic_cfg.lr,
                                           weight_decay=critic_cfg.weight_decay)
        warmup = critic_cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)

    def state_dict(self) -> dict:
        """Weights, optimizer (with master weights) and scheduler: what a one-process resume
        restores (sharded runs save through distributed/checkpoint.py instead)."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    @replicated("critic")
    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] values under the current critic, zero on masked tokens."""
        self.forward_module.eval()
        values = map_rows(batch, self.dp, self.micro_batch_size,
                          lambda micro: response_values(self.forward_module, micro, self.device))
        return values.cpu() * batch.response_mask

    @replicated("critic")
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Fit V to ``batch.returns`` with the clipped loss around ``batch.values`` (V_old)."""
        if batch.values is None or batch.returns is None:
            raise ValueError("the critic update needs batch.values (old) and batch.returns (GAE targets)")
        self.forward_module.train()
        history = [self._optimizer_step(batch.select(mini))
                   for _ in range(self.cfg.ppo_epochs)
                   for mini in torch.arange(batch.batch_size).chunk(self.cfg.mini_batches)]
        metrics = {k: sum(h[k] for h in history) / len(history) for k in history[0]}
        mask = batch.response_mask
        metrics["critic/values_mean"] = float(masked_mean(batch.values, mask))
        metrics["critic/returns_mean"] = float(masked_mean(batch.returns, mask))
        metrics["critic/explained_variance"] = explained_variance(batch.values, batch.returns, mask)
        return metrics

    def _optimizer_step(self, mini: TrainBatch) -> dict[str, float]:
        global_tokens, global_seqs = global_counts(mini.response_mask)  # every rank holds the whole mini-batch
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for micro, rows in micro_batches(mini, self.dp, self.micro_batch_size):
            values = response_values(self.forward_module, micro, self.device)
            device = values.device
            loss, stats = compute_value_loss(
                values, micro.values.to(device), micro.returns.to(device), micro.response_mask.to(device),
                cliprange_value=self.cfg.cliprange_value, loss_agg_mode=self.loss_agg_mode,
                global_tokens=global_tokens, global_seqs=global_seqs, loss_scale_factor=self.loss_scale_factor)
            loss.backward()
            # micro losses sum to the mini-batch loss; per-micro stats are averaged by rows
            sums["critic/vf_loss"] = sums.get("critic/vf_loss", 0.0) + loss.detach().item()
            for key, value in stats.items():
                sums[f"critic/{key}"] = sums.get(f"critic/{key}", 0.0) + value * rows / mini.batch_size
        sums = self.dp.sum_metrics(sums)
        if self.dp.sharded:
            grad_norm = float(clip_grad_norm(self.forward_module.parameters(), self.cfg.grad_clip, self.dp))
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(trained_parameters(self.optimizer), self.cfg.grad_clip))
        if math.isfinite(grad_norm):  # the norm is global: every rank takes the same branch
            self.optimizer.step()
            if not self.dp.sharded:
                check_parameters_finite(self.model, "the critic's optimizer step")
        else:  # a NaN/Inf gradient would poison the weights: skip the step
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        sums["critic/grad_norm"] = grad_norm
        sums["critic/lr"] = self.scheduler.get_last_lr()[0]
        return sums
