"""Optional packages the built-in rewards need, checked when a run starts.

Without them a reward call fails in its worker and scores ``default_score``: a whole run of
zero rewards and 0.0 accuracy that exits 0. Checking the configured rewards before anything
loads turns that into one named error: ``reward 'math' needs math-verify: pip install
'asyncrl[tasks]'``.
"""
from __future__ import annotations

import importlib.util
from typing import Iterable, Union

#: reward name -> (module it imports, the pip package, the asyncrl extra that installs it)
REWARD_EXTRAS = {
    "math": ("math_verify", "math-verify", "tasks"),
    "gsm8k": ("math_verify", "math-verify", "tasks"),
}


def _reward_name(entry: Union[str, dict]) -> str:
    return entry.get("fn", "") if isinstance(entry, dict) else str(entry)


def missing_reward_dependencies(entries: Iterable[Union[str, dict]]) -> list[str]:
    """One message per configured reward whose optional package is not importable."""
    messages = []
    for name in dict.fromkeys(_reward_name(e) for e in entries):
        if name in REWARD_EXTRAS:
            module, package, extra = REWARD_EXTRAS[name]
            if importlib.util.find_spec(module) is None:
                messages.append(f"reward {name!r} needs {package}: pip install 'asyncrl[{extra}]'")
    return messages
