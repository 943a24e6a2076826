"""Routing replay (R3) for MoE policies: the trainer's forward uses the experts the rollout chose.

A MoE model's log-probs depend on a discrete top-k choice per token and layer; tiny numeric
differences between the engine and the trainer flip it (~10% of routers in Qwen3-30B-A3B,
SCALE.md §3.5), which makes the importance ratio noisy and MoE RL unstable. R3 records the
rollout's expert ids (the engine returns them: ``Completion.routed_experts``) and replays them
in the trainer: each router keeps computing its own scores, but the indices are replaced by the
recorded ones and the weights recomputed from the current softmax, ``probs.gather(ids)``
(renormalised iff the router renormalises), so gradients still reach the router (slime, verl).

Mechanism: a forward hook on every router module of the HF model (``*TopKRouter``: returns
``(logits, weights, ids)``), numbered in module order = decoder-layer order, which is the
engine's MoE-layer order. The hook is stateless per forward (no cursor): ``use(routes, mask)``
sets the routes of the coming forwards, aligned with their flattened ``[B * T]`` tokens, so
activation recomputation replays the same ids. Rows where ``mask`` is False (padding, the last
response token, which the engine never ran) are routed natively.

Whether or not it replays, it counts how often the trainer's own top-k set differs from the
rollout's: ``mismatch_rate`` = differing (token, layer) pairs / compared pairs (the metric
``actor/routing_mismatch``).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch

_HOOKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its RoutingReplay


def replay_of(model) -> Optional["RoutingReplay"]:
    """The RoutingReplay hooked on ``model`` (None: none)."""
    return _HOOKED.get(model)


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k router modules of an HF MoE model, in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def routes_from_completions(rows: list[tuple[int, Optional[torch.Tensor]]], prompt_length: int,
                            length: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Per-row engine routing ``(prompt_len_i, [P_i + R_i - 1, L, K])`` -> (routes ``[B, P + L_resp, L, K]``
    int16, mask ``[B, P + L_resp]`` bool) in the trainer's layout (prompt left-padded to P, response
    right-padded), or None when any row has none."""
    if not rows or any(r is None for _, r in rows):
        return None
    _, first = rows[0]
    routes = torch.zeros(len(rows), prompt_length + length, *first.shape[1:], dtype=torch.int16)
    mask = torch.zeros(len(rows), prompt_length + length, dtype=torch.bool)
    for b, (plen, r) in enumerate(rows):
        start = prompt_length - plen
        routes[b, start:start + r.shape[0]] = r.to(torch.int16)
        mask[b, start:start + r.shape[0]] = True
    return routes, mask


class RoutingReplay:
    """Hooks on the routers of ``model``; ``replay=False`` only measures the mismatch."""

    def __init__(self, model: torch.nn.Module, replay: bool = True):
        self.routers = find_routers(model)
        self.replay = replay
        self.routes: Optional[torch.Tensor] = None  # [N, L, K] for the coming forwards
        self.mask: Optional[torch.Tensor] = None    # [N] bool
        self.differ = 0.0
        self.compared = 0.0
        self.recomputing = False  # activation recomputation: replay, but count nothing twice
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        self.model = model
        _HOOKED[model] = self  # recompute.py finds it there: a recomputed layer replays too

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if _HOOKED.get(self.model) is self:
            del _HOOKED[self.model]

    def state(self) -> tuple:
        """The routes the coming forwards see (what :meth:`recomputed` puts back)."""
        return self.routes, self.mask

    @contextlib.contextmanager
    def recomputed(self, state: tuple):
        """Within: the routes of ``state`` (a checkpointed layer recomputed in backward, after
        :meth:`use` has ended), without counting the mismatch a second time."""
        saved = self.routes, self.mask, self.recomputing
        self.routes, self.mask = state
        self.recomputing = True
        try:
            yield
        finally:
            self.routes, self.mask, self.recomputing = saved

    @contextlib.contextmanager
    def use(self, routes: torch.Tensor, mask: torch.Tensor):
        """Forwards inside see ``routes [B, T, L, K]`` / ``mask [B, T]`` for their ``[B, T]`` input."""
        if routes.shape[2] != len(self.routers):
            raise ValueError(f"routing has {routes.shape[2]} MoE layers, the model {len(self.routers)}")
        self.routes, self.mask = routes.flatten(0, 1), mask.flatten()
        try:
            yield self
        finally:
            self.routes = self.mask = None

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self.routes is None:
                return None
            logits, weights, ids = output
            if ids.shape[0] != self.routes.shape[0]:
                raise ValueError(f"router saw {ids.shape[0]} tokens, the routes cover {self.routes.shape[0]}: "
                                 "routing replay needs the padded [B, P + L] layout")
            recorded = self.routes[:, layer].to(device=ids.device, dtype=ids.dtype)
            mask = self.mask.to(ids.device)
            if not self.recomputing:
                with torch.no_grad():
                    differ = (ids.sort(-1).values != recorded.sort(-1).values).any(-1) & mask
                    self.differ += float(differ.sum())
                    self.compared += float(mask.sum())
            if not self.replay:
                return None
            new_ids = torch.where(mask[:, None], recorded, ids)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            new_weights = probs.gather(1, new_ids)
            if getattr(module, "norm_topk_prob", True):  # Qwen3.5-MoE routers always renormalise
                new_weights = new_weights / new_weights.sum(-1, keepdim=True)
            return logits, new_weights.to(weights.dtype), new_ids
        return hook

    def mismatch_rate(self, reset: bool = True) -> Optional[float]:
        """Differing (token, layer) top-k sets / compared ones since the last reset (None: none)."""
        rate = self.differ / self.compared if self.compared else None
        if reset:
            self.differ = self.compared = 0.0
        return rate
