"""Metrics of the members of a pool: the replicas of a rollout fleet, the components of a
reward pool. One key scheme and one sum over members, so the code that writes per-member
metrics (``rollout/fleet.py``), the code that reads them back (``metrics/fleet.py``) and the
pool totals (``rewards/pool.py``) cannot drift apart.

    key = "<group>/<member>/<name>"          e.g. fleet/replica1/busy
"""
from __future__ import annotations

from typing import Iterable, Mapping


def member_key(group: str, member: str, name: str) -> str:
    """``fleet/replica1/busy`` for ``("fleet", "replica1", "busy")``."""
    return f"{group}/{member}/{name}"


def member_values(metrics: Mapping[str, float], group: str, name: str) -> dict[str, float]:
    """``{member: value}`` of every ``<group>/<member>/<name>`` key in ``metrics``."""
    out = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == group and parts[2] == name:
            out[parts[1]] = value
    return out


def member_totals(per_member: Mapping[str, Mapping[str, float]], names: Iterable[str]) -> dict[str, float]:
    """Each counter in ``names`` summed over the members (0 with no members)."""
    return {name: sum(counters[name] for counters in per_member.values()) for name in names}
