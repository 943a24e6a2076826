"""One control group per sandboxed run: memory, process count and CPU for *everything*
the run starts, not per process (rlimits are per process, or per uid).

``RunCgroup.create(memory_bytes, max_pids, cpus)`` makes a child of the caller's own
cgroup (so the run still counts against whatever limits the caller lives under),
sets the limits and returns it; the launcher writes the sandbox's first pid into
``procs_files`` before it starts bubblewrap, so no child can be born outside it.
After the run, ``close()`` kills what is left in it and removes it.

cgroup v2 (one unified hierarchy; memory.max, memory.swap.max, pids.max, cpu.max) is
used when the caller's cgroup can have children with the memory and pids controllers
(root of the hierarchy, or a delegated cgroup named by ``parent``). Otherwise cgroup v1
(one hierarchy per controller: memory.limit_in_bytes and memsw, pids.max,
cpu.cfs_quota_us), which is what hybrid hosts such as this project's CI VM have. When
neither can be written (an unprivileged caller without delegation), ``create`` returns
None with the reason, and the sandbox falls back to per-process rlimits, named as such
in the run's ``isolation`` record.

Invariant: a cgroup directory this module made is removed by ``close()``; a directory
left by a process that was killed first is named ``asyncrl-sb-<pid>-<token>`` and is
swept by the next ``create`` once that pid is gone.
"""
from __future__ import annotations

import functools
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from typing import Optional

PREFIX = "asyncrl-sb-"
_V1_CONTROLLERS = ("memory", "pids", "cpu")
_CPU_PERIOD_US = 100_000


@dataclass
class RunCgroup:
    """The cgroup (v2: one directory; v1: one per controller) of one sandboxed run."""

    version: str  # "cgroup-v2" | "cgroup-v1"
    dirs: list[str]
    _closed: bool = field(default=False, repr=False)

    @property
    def procs_files(self) -> list[str]:
        """Where the launcher writes its pid (every hierarchy, for v1)."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int, cpus: float,
               parent: Optional[str] = None) -> tuple[Optional["RunCgroup"], str]:
        """A limited cgroup for one run, or (None, why not)."""
        v2_base, why_v2 = _v2_base(parent)
        if v2_base is not None:
            try:
                return cls._make_v2(v2_base, memory_bytes, max_pids, cpus), ""
            except OSError as err:
                why_v2 = f"cgroup v2 at {v2_base}: {err.strerror or err}"
        if parent is not None:
            return None, why_v2
        bases = _v1_bases()
        if not bases:
            return None, f"{why_v2}; no cgroup v1 memory/pids/cpu hierarchies"
        try:
            return cls._make_v1(bases, memory_bytes, max_pids, cpus), ""
        except OSError as err:
            return None, f"{why_v2}; cgroup v1: {err.strerror or err} ({getattr(err, 'filename', '')})"

    @classmethod
    def _make_v2(cls, base: str, memory_bytes: int, max_pids: int, cpus: float) -> "RunCgroup":
        _sweep_stale([base])
        run = cls("cgroup-v2", [os.path.join(base, _new_name())])
        os.mkdir(run.dirs[0])
        try:
            _write(run.dirs[0], "memory.max", memory_bytes)
            _write(run.dirs[0], "memory.swap.max", 0, optional=True)
            _write(run.dirs[0], "pids.max", max_pids)
            _write(run.dirs[0], "cpu.max", f"{int(cpus * _CPU_PERIOD_US)} {_CPU_PERIOD_US}", optional=True)
        except OSError:
            run.close()
            raise
        return run

    @classmethod
    def _make_v1(cls, bases: dict[str, str], memory_bytes: int, max_pids: int, cpus: float) -> "RunCgroup":
        _sweep_stale(list(bases.values()))
        name = _new_name()
        run = cls("cgroup-v1", [])
        try:
            for controller, base in bases.items():
                path = os.path.join(base, name)
                os.mkdir(path)
                run.dirs.append(path)
                if controller == "memory":
                    _write(path, "memory.limit_in_bytes", memory_bytes)
                    _write(path, "memory.memsw.limit_in_bytes", memory_bytes, optional=True)  # no swap on top
                elif controller == "pids":
                    _write(path, "pids.max", max_pids)
                else:
                    _write(path, "cpu.cfs_period_us", _CPU_PERIOD_US)
                    _write(path, "cpu.cfs_quota_us", int(cpus * _CPU_PERIOD_US))
        except OSError:
            run.close()
            raise
        return run

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer ended a process of this run."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    with open(os.path.join(d, name)) as fh:
                        for line in fh:
                            key, _, value = line.partition(" ")
                            if key == "oom_kill" and int(value) > 0:
                                return True
                except (OSError, ValueError):
                    continue
        return False

    def pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.procs_files:
            try:
                with open(path) as fh:
                    found.update(int(line) for line in fh if line.strip())
            except OSError:
                pass
        return sorted(found)

    def close(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process left in the run, then remove the directories."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            _write(d, "cgroup.kill", 1, optional=True)  # v2, Linux >= 5.14: the kernel kills them all
        while True:
            left = self.pids()
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for d in list(self.dirs):
                try:
                    os.rmdir(d)
                    self.dirs.remove(d)
                except FileNotFoundError:
                    self.dirs.remove(d)
                except OSError:
                    pass  # EBUSY: a dying process is still attached
            if not self.dirs or time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _new_name() -> str:
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def _write(directory: str, name: str, value, optional: bool = False) -> None:
    try:
        with open(os.path.join(directory, name), "w") as fh:
            fh.write(str(value))
    except FileNotFoundError:
        if not optional:
            raise
    except OSError:
        if not optional:
            raise


def _sweep_stale(bases: list[str]) -> None:
    """Remove empty run cgroups whose creator process is gone (it was killed)."""
    for base in bases:
        try:
            entries = os.listdir(base)
        except OSError:
            continue
        for entry in entries:
            if not entry.startswith(PREFIX):
                continue
            pid = entry[len(PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(base, entry))
                except OSError:
                    pass


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    found = []
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fstype, _source, options = (right.split() + ["", "", ""])[:3]
                if fstype in ("cgroup", "cgroup2"):
                    found.append((left.split()[4], fstype, set(options.split(","))))
    except OSError:
        pass
    return found


def _own_paths() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    try:
        with open("/proc/self/cgroup") as fh:
            for line in fh:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(",") if controllers else [""]:
                    paths[controller] = path
    except OSError:
        pass
    return paths


def _v2_base(parent: Optional[str]) -> tuple[Optional[str], str]:
    """The v2 directory to create run cgroups under, with memory and pids enabled."""
    if parent is None:
        mount = next((m for m, fstype, _ in _mounts() if fstype == "cgroup2"), None)
        if mount is None:
            return None, "no cgroup v2 mount"
        parent = os.path.join(mount, _own_paths().get("", "/").lstrip("/"))
    try:
        with open(os.path.join(parent, "cgroup.controllers")) as fh:
            available = set(fh.read().split())
    except OSError as err:
        return None, f"cgroup v2 parent {parent}: {err.strerror or err}"
    if not {"memory", "pids"} <= available:
        return None, f"cgroup v2 at {parent} lacks the memory/pids controllers (has: {' '.join(sorted(available)) or 'none'})"
    try:
        with open(os.path.join(parent, "cgroup.subtree_control")) as fh:
            enabled = set(fh.read().split())
        missing = {"memory", "pids", "cpu"} & available - enabled
        if missing:  # only possible where the parent holds no process itself (or is the root)
            _write(parent, "cgroup.subtree_control", " ".join(f"+{c}" for c in sorted(missing)))
    except OSError as err:
        return None, f"cgroup v2 at {parent}: cannot enable controllers for children ({err.strerror or err})"
    return parent, ""


@functools.lru_cache(maxsize=1)
def _v1_bases() -> dict[str, str]:
    """Controller -> this process's directory in that v1 hierarchy (all three or none)."""
    own = _own_paths()
    bases = {}
    for mount, fstype, options in _mounts():
        if fstype != "cgroup":
            continue
        for controller in _V1_CONTROLLERS:
            if controller in options and controller in own:
                bases[controller] = os.path.join(mount, own[controller].lstrip("/"))
    return bases if set(bases) == set(_V1_CONTROLLERS) else {}
