"""The figure of bench/peer_trl.py: held-out accuracy against steps and against training seconds.

Four panels: greedy and sampled accuracy (rows) against optimizer steps and against training
wall seconds (columns); one colour per framework, one line per seed.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"trl": "tab:red", "asyncrl-sync": "tab:blue", "asyncrl-async": "tab:green"}


def plot(result: dict, path: str) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharey="row")
    seen = set()
    for run in result["runs"]:
        name = run["summary"]["framework"]
        evals = run["evals"]
        label = name if name not in seen else None
        seen.add(name)
        for row, metric in enumerate(("greedy", "sampled")):
            ys = [e[metric] for e in evals]
            axes[row][0].plot([e["step"] for e in evals], ys, color=COLOURS.get(name), label=label, alpha=0.8)
            axes[row][1].plot([e["train_seconds"] for e in evals], ys, color=COLOURS.get(name), alpha=0.8)
    for row, metric in enumerate(("greedy", "sampled")):
        axes[row][0].set_ylabel(f"held-out accuracy ({metric})")
        axes[row][0].set_xlabel("optimizer steps")
        axes[row][1].set_xlabel("training seconds (evaluation excluded)")
        for ax in axes[row]:
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    seeds = sorted({r["summary"]["seed"] for r in result["runs"]})
    fig.suptitle(f"GRPO on 1-3 digit addition, 0.79M Qwen3, CPU: TRL vs asyncrl (seeds {seeds})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
