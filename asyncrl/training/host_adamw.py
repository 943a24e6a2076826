"""AdamW whose moments live in host memory (``actor.offload=optimizer``).

Adam's two fp32 moments are 8 bytes per parameter: 66 GB for an 8B model, more than its fp32
weights and gradients together. Here they stay in (pinned) host memory between steps; a step
streams them to the device one chunk of parameters at a time (``chunk_bytes``), runs torch's
own AdamW kernel there (``torch.optim.adam.adam`` with decoupled weight decay, fused where
torch has a fused kernel: the same arithmetic as ``torch.optim.AdamW``), and copies them back.
Peak extra device memory is one chunk of moments. torchao's ``CPUOffloadOptimizer`` instead
steps on the CPU and does not take FSDP2's DTensor parameters; DeepSpeed's ZeRO-Offload needs
DeepSpeed's engine.

It is a ``torch.optim.AdamW``: param groups, ``state_dict`` keys (``step``, ``exp_avg``,
``exp_avg_sq``), LR schedulers and DCP checkpoints see no difference. For a DTensor parameter
(FSDP2) the moments are DTensors with the same mesh and placements whose local shard is on
the host, so DCP saves and reshards them like any optimizer state.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_step  # the functional AdamW runs (decoupled weight decay)

from asyncrl.training.optim import supports_fused

DEFAULT_CHUNK_BYTES = 1 << 30  # moments of ~134M parameters per transfer: big copies, bounded memory


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _host_like(param: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``param``'s local shard, in (pinned, when a GPU exists) host memory;
    a DTensor with ``param``'s layout when ``param`` is one."""
    local = torch.zeros(_local(param).shape, dtype=param.dtype, device="cpu")
    if torch.cuda.is_available():
        local = local.pin_memory()
    if isinstance(param, DTensor):
        # not DTensor.from_local: it moves the shard to the mesh's device (every moment on the GPU,
        # as the H200 run found); built as FSDP2's CPU offload builds its host parameter shards
        return DTensor(local, param._spec, requires_grad=False)
    return local


class HostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` with ``exp_avg`` / ``exp_avg_sq`` in host memory (see module doc).

    Invariant: between steps every moment tensor lives on the CPU; ``step`` counters live on
    the parameter's device (as torch's fused AdamW keeps them)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), weight_decay: float = 0.01, eps: float = 1e-8,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        params = list(params)
        self.chunk_bytes = chunk_bytes
        self._fused = supports_fused([_local(p) for p in params])
        super().__init__(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps,
                         fused=self._fused or None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        devices = set()
        for group in self.param_groups:
            chunk, size = [], 0
            for param in (p for p in group["params"] if p.grad is not None):
                chunk.append(param)
                size += 2 * _local(param).numel() * _local(param).element_size()
                if size >= self.chunk_bytes:
                    devices.add(self._step_chunk(group, chunk))
                    chunk, size = [], 0
            if chunk:
                devices.add(self._step_chunk(group, chunk))
        for device in devices:  # the moments' copies back to the host are complete when step returns
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        return loss

    def _step_chunk(self, group: dict, params: list[torch.Tensor]) -> torch.device:
        """One chunk on its device; copies, kernel and copies back are queued on one stream,
        so a chunk's device buffers are reused only after its moments went back."""
        states = [self._state(p) for p in params]
        device = _local(params[0]).device
        exp_avgs = [_local(s["exp_avg"]).to(device, non_blocking=True) for s in states]
        exp_avg_sqs = [_local(s["exp_avg_sq"]).to(device, non_blocking=True) for s in states]
        beta1, beta2 = group["betas"]
        adam_step(
            [_local(p) for p in params], [_local(p.grad) for p in params], exp_avgs, exp_avg_sqs, [],
            [s["step"] for s in states], foreach=False if self._fused else None, fused=self._fused or None,
            decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for state, avg, avg_sq in zip(states, exp_avgs, exp_avg_sqs):
            _local(state["exp_avg"]).copy_(avg, non_blocking=True)
            _local(state["exp_avg_sq"]).copy_(avg_sq, non_blocking=True)
        return device

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            dtype = torch.float32
            state["step"] = torch.zeros((), dtype=dtype, device=_local(param).device) if self._fused \
                else torch.tensor(0.0, dtype=dtype)
            state["exp_avg"] = _host_like(param)
            state["exp_avg_sq"] = _host_like(param)
        return state

    @staticmethod
    def _process_value_according_to_param_policy(param, value, param_id, param_groups, key=None):
        """Loading a state dict: moments stay on the host (torch's default moves them to the
        parameter's device, which would put every moment on the GPU at once)."""
        if key == "step":
            return torch.optim.AdamW._process_value_according_to_param_policy(param, value, param_id, param_groups,
                                                                               key)
        return value.to(dtype=param.dtype, device="cpu") if not isinstance(value, DTensor) else value.to(
            dtype=param.dtype)
