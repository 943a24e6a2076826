"""Run untrusted Python in a sandboxed subprocess: ``run_python(source, ...)``.

What is enforced (see docs/rewards.md for the full table):
  * wall time: the parent kills the whole process group after ``wall_time_s``;
  * CPU time (RLIMIT_CPU), address space (RLIMIT_AS), process count (RLIMIT_NPROC),
    file size (RLIMIT_FSIZE, which also caps stdout/stderr), no core dumps;
  * no network: an empty network namespace where the kernel allows one, and in
    every case an audit hook that refuses non-Unix sockets;
  * an isolated temporary working directory, removed afterwards whatever happened;
  * ``python -I`` (no user site, no PYTHON* environment), a minimal environment;
  * when the caller is root: a fresh throw-away uid per run, so RLIMIT_NPROC applies
    (root is exempt from it), the parent cannot be signalled, and every process the
    program left behind is killed by uid at the end.

What is not: a determined program can defeat the in-process audit hook (it runs in
the same interpreter), read files that its uid can read, and write under
world-writable directories at the OS level (the hook refuses it from Python). Use
containers or gVisor for adversarial code at scale; this sandbox contains mistakes
and reward-hacking accidents of a policy model, not an attacker.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

_BOOT = str(Path(__file__).with_name("_sandbox_boot.py"))
_MB = 1024 * 1024


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 16
    max_file_mb: int = 16
    network: bool = False
    max_output_bytes: int = 64 * 1024  # of stdout / stderr kept in the result


@dataclass
class SandboxResult:
    """What a run did. ``status``: ok | error | timeout | cpu_limit | memory_limit |
    file_limit | killed (by a signal: SIGKILL from the CPU hard limit, the OOM killer) |
    sandbox_error (the sandbox itself failed to start; see stderr)."""

    status: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    report: list[str] = field(default_factory=list)  # lines the program wrote to the report fd
    isolation: dict = field(default_factory=dict)  # what the bootstrap enforced

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(
    source: str,
    stdin: str = "",
    limits: Optional[SandboxLimits] = None,
    files: Optional[dict[str, str]] = None,
) -> SandboxResult:
    """Run ``source`` as ``main.py`` in a fresh sandbox and return what happened.

    ``files`` are extra text files created next to ``main.py``. The program may write
    result lines to the file descriptor named by the ``ASYNCRL_REPORT_FD`` environment
    variable (they come back in ``report``), a channel separate from its stdout.
    Never raises for anything the program does.
    """
    limits = limits or SandboxLimits()
    uid = _sandbox_uid()
    work = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-"))
    private = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-io-"))  # parent-only
    try:
        _populate(work, {"main.py": source, **(files or {})}, uid)
        with open(private / "out", "w+b") as out, open(private / "err", "w+b") as err, \
                open(private / "report", "w+b") as report:
            start = time.monotonic()
            returncode, timed_out = _launch(work, uid, limits, stdin, out, err, report)
            wall = time.monotonic() - start
            stdout, stderr = _read(out, limits.max_output_bytes), _read(err, limits.max_output_bytes)
            report_lines = _read(report, 16 * _MB).splitlines()
        isolation = json.loads(report_lines.pop(0)) if report_lines and report_lines[0].startswith("{") else {}
        if uid is not None and not isolation.get("pid_namespace"):
            _kill_by_uid(uid)
        # No isolation line: the bootstrap failed before the program started, which is
        # the sandbox's fault, not the program's.
        status = _classify(returncode, timed_out, stderr) if isolation or timed_out else "sandbox_error"
        return SandboxResult(status, returncode, stdout, stderr, wall, report_lines, isolation)
    finally:
        _remove(work)
        _remove(private)


def _sandbox_uid() -> Optional[int]:
    """A random unused-looking uid when we are root (None otherwise).

    Random in a high range so that concurrent sandboxes (pool workers) never share
    a uid: RLIMIT_NPROC and the final kill-by-uid are then per run.
    """
    if os.geteuid() != 0:
        return None
    return 1_000_000 + secrets.randbelow(1_000_000_000)


def _populate(work: Path, files: dict[str, str], uid: Optional[int]) -> None:
    for name, text in files.items():
        path = (work / name).resolve()
        if work.resolve() not in path.parents:
            raise ValueError(f"sandbox file {name!r} escapes the working directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if uid is not None:
        for path in [work, *work.rglob("*")]:
            os.chown(path, uid, uid)
    os.chmod(work, 0o700)


def _nproc_limit(limits: SandboxLimits, uid: Optional[int]) -> int:
    """RLIMIT_NPROC counts every process of the real uid, not just the sandbox's:
    for a shared uid, allow what the user already runs plus ``max_processes``."""
    if uid is not None:
        return limits.max_processes
    mine = os.getuid()
    running = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                running += entry.stat().st_uid == mine
            except OSError:
                pass
    return running + limits.max_processes


def _launch(work: Path, uid, limits: SandboxLimits, stdin: str, out, err, report) -> tuple[Optional[int], bool]:
    """Start the bootstrap, wait up to the wall time, kill everything it left."""
    cfg = {
        "uid": uid, "network": limits.network, "report_fd": report.fileno(),
        "cpu_s": max(1, int(limits.cpu_time_s)), "memory_bytes": int(limits.memory_mb * _MB),
        "nproc": _nproc_limit(limits, uid), "fsize_bytes": int(limits.max_file_mb * _MB),
    }
    env = {
        "PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
        # one thread per BLAS/OpenMP pool: runs share the CPUs with the trainer
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "ASYNCRL_REPORT_FD": str(report.fileno()),
    }
    proc = subprocess.Popen(
        [sys.executable, "-I", _BOOT, json.dumps(cfg)], cwd=work, env=env,
        stdin=subprocess.PIPE, stdout=out, stderr=err, pass_fds=(report.fileno(),),
        start_new_session=True,  # its own process group: one killpg reaches its children
    )
    # A timer kills the group at the deadline, so the wait below can block (it
    # returns the moment the program exits) instead of polling.
    fired = threading.Event()

    def on_deadline() -> None:
        fired.set()
        _kill_group(proc)

    deadline = threading.Timer(limits.wall_time_s, on_deadline)
    deadline.start()
    try:
        try:
            proc.stdin.write(stdin.encode("utf-8", errors="replace"))
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass  # the program exited (or was killed) without reading its stdin
        # Wait for exit without reaping: until reaped, the pid (= the group id)
        # cannot be reused, so the killpg below cannot hit an unrelated group.
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    finally:
        deadline.cancel()
        deadline.join()
        _kill_group(proc)
        proc.wait()
    return proc.returncode, fired.is_set()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the program's process group (with a PID namespace this also ends
    every process inside it: the namespace's first process is in the group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_by_uid(uid: int) -> None:
    """Without a PID namespace, children that called setsid() escaped the group:
    kill(-1) as the sandbox uid reaches exactly that uid's processes. Repeated
    because a fork bomb may fork between the scan and the signal."""
    for _ in range(3):
        subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _read(fh, limit: int) -> str:
    fh.seek(0)
    data = fh.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n...[truncated]" if len(data) > limit else "")


def _classify(returncode: Optional[int], timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit"
    if returncode == -signal.SIGXFSZ:
        return "file_limit"
    if "MemoryError" in stderr:
        return "memory_limit"
    if returncode is not None and returncode < 0:
        return "killed"
    return "error"


def _remove(path: Path) -> None:
    """Delete a tree even if the program made parts of it unwritable."""

    def make_writable_and_retry(func, target, _exc):
        try:
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)
