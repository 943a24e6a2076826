"""Per-step metrics of multi-turn episodes (``workflow/*``, docs/metrics.md)."""
from __future__ import annotations


def workflow_metrics(outputs) -> dict[str, float]:
    """Means over the step's episodes; empty when the outputs are single-turn completions."""
    comps = [c for out in outputs for c in out.completions if "turns" in c.info]
    if not comps:
        return {}
    n = len(comps)
    inserted = [len(c.loss_mask) - sum(c.loss_mask) for c in comps if c.loss_mask is not None]
    return {"workflow/turns_mean": sum(c.info["turns"] for c in comps) / n,
            "workflow/tool_calls_mean": sum(c.info.get("tool_calls", 0) for c in comps) / n,
            "workflow/tool_call_rate": sum(c.info.get("tool_calls", 0) > 0 for c in comps) / n,
            "workflow/truncated_fraction": sum(bool(c.info.get("truncated")) for c in comps) / n,
            "workflow/inserted_tokens_mean": sum(inserted) / max(len(inserted), 1)}
