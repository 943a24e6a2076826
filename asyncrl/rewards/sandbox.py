"""Run untrusted Python behind the kernel's walls: ``run_python(source, ...)``.

The walls (docs/rewards.md has the full table):
  * bubblewrap (``walls``): private read-only root with only /usr and the Python
    installation, one size-limited tmpfs for every writable byte, private /proc and
    /dev; new PID, network, IPC, UTS, cgroup (and for unprivileged callers, user)
    namespaces; no capabilities, no-new-privileges, a new session;
  * seccomp (``seccomp_policy``): a system-call allow-list for Python, then exec refused;
  * a throw-away uid per run when the caller is root;
  * a cgroup per run (``cgroup``) for memory, processes and CPU of everything it starts,
    where the host lets us make one; else per-process rlimits, named as the fallback;
  * rlimits in every case (CPU seconds, address space, file size, processes, no cores)
    and a wall-clock deadline after which the whole run is killed;
  * the in-process audit hook of the bootstrap, as a second line only.

Where bubblewrap cannot build these walls (not installed, user namespaces disabled),
``run_python`` raises ``SandboxUnavailable`` naming the cause, unless the caller chose
``SandboxLimits(isolation="weak")``: the previous in-process sandbox (namespaces where
the kernel grants them, rlimits, audit hook, seccomp when available), which contains a
policy's mistakes but not a program written to escape.

Nothing a run writes reaches the host's file system (kernel mode): its files live on
its own tmpfs, which disappears with its mount namespace; stdout/stderr go to unnamed
temporary files of the caller.
"""
from __future__ import annotations

import json
import logging
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

from asyncrl.rewards import seccomp_policy, walls
from asyncrl.rewards.cgroup import RunCgroup
from asyncrl.rewards.walls import SandboxUnavailable

__all__ = ["SandboxLimits", "SandboxResult", "SandboxRun", "SandboxUnavailable", "run_python"]

logger = logging.getLogger(__name__)
_MB = 1024 * 1024
ISOLATION_MODES = ("kernel", "weak")
# The cgroup join: the shell writes its own pid into each cgroup, then becomes bwrap,
# so bwrap and everything it starts are born inside the run's cgroup.
_JOIN_CGROUP = 'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 126; shift; done; shift; exec "$@"'
_cgroup_warned = threading.Event()


@dataclass
class SandboxLimits:
    """Resource limits and the isolation mode of one sandboxed run.

    ``memory_mb``, ``max_processes`` and ``cpus`` hold for the whole run (a cgroup)
    where the host allows one, else per process (RLIMIT_AS) and per run's uid or user
    namespace (RLIMIT_NPROC); ``SandboxResult.isolation`` says which. ``disk_mb`` bounds
    every byte the run writes (one tmpfs); ``max_file_mb`` one file (and stdout/stderr).
    ``isolation="weak"`` accepts the in-process sandbox where the kernel one is missing.
    """

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 16
    max_file_mb: int = 16
    disk_mb: int = 64
    cpus: float = 1.0
    network: bool = False
    max_output_bytes: int = 64 * 1024  # of stdout / stderr kept in the result
    isolation: str = "kernel"
    cgroup_parent: Optional[str] = None  # a delegated cgroup v2 directory to create runs under

    def __post_init__(self):
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"SandboxLimits.isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}")


@dataclass
class SandboxResult:
    """What a run did. ``status``: ok | error | timeout | cpu_limit | memory_limit |
    file_limit | killed (by a signal) | stopped (ended by the caller, done with it) |
    sandbox_error (the sandbox itself failed to start; see stderr). ``isolation`` records what was enforced."""

    status: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    isolation: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(source: str, stdin: str = "", limits: Optional[SandboxLimits] = None,
               files: Optional[dict[str, str]] = None) -> SandboxResult:
    """Run ``source`` as ``main.py`` in a fresh sandbox and return what happened.

    ``files`` are extra text files next to ``main.py`` (importable by it). Raises
    ``SandboxUnavailable`` when the kernel sandbox cannot run here (see the module
    docstring); never raises for anything the program does.
    """
    run = SandboxRun("main.py", {"main.py": source, **(files or {})}, limits or SandboxLimits())
    return run.wait(stdin)


class SandboxRun:
    """One sandboxed interpreter, started at construction, running ``main``.

    ``main`` is a file of ``files`` (run from the working directory) or, with
    ``boot_main=True``, a script of ``asyncrl/rewards/standalone`` (the candidate
    server). ``pass_fds`` are extra descriptors the program keeps (same numbers),
    announced to it in ``env``. Call ``wait()`` exactly once; it always cleans up.
    """

    def __init__(self, main: str, files: dict[str, str], limits: SandboxLimits,
                 pass_fds: tuple[int, ...] = (), env: Optional[dict[str, str]] = None, boot_main: bool = False):
        self.limits = limits
        self._weak = limits.isolation == "weak"
        if not self._weak:
            why = walls.probe(limits.network)
            if why:
                raise SandboxUnavailable(
                    f"kernel sandbox unavailable: {why}. Install bubblewrap, or accept the weaker in-process "
                    "sandbox explicitly: SandboxLimits(isolation='weak'), or the code reward's sandbox='weak'")
        self._uid = 1_000_000 + secrets.randbelow(1_000_000_000) if os.geteuid() == 0 else None
        blocked = self._weak and self._uid is not None and boot_main and walls.weak_mode_blocker(main)
        if blocked:
            raise SandboxUnavailable(
                f"weak sandbox unavailable: its throw-away uid cannot read {blocked} on the way to asyncrl's "
                f"rewards/standalone/{main}, which it runs after switching to that uid. Install asyncrl where "
                "other users can read it (or chmod o+x that directory), or use the kernel sandbox (bubblewrap)")
        self._work: Optional[Path] = None  # weak mode's host working directory
        self._stopped = False
        self._cleanup_fds: list[int] = []  # closed once the child holds them
        # stdout, stderr, the bootstrap's status line, bwrap's info (the sandbox init's pid)
        self._out, self._err, self._status, self._info = (tempfile.TemporaryFile() for _ in range(4))
        self._cgroup, why_no_cgroup = RunCgroup.create(
            limits.memory_mb * _MB, limits.max_processes, limits.cpus, limits.cgroup_parent)
        if self._cgroup is None and not _cgroup_warned.is_set():
            _cgroup_warned.set()
            logger.warning("sandbox: no cgroup for the run's memory/processes/CPU (%s); "
                           "falling back to per-process rlimits", why_no_cgroup)
        self._facts = {"mode": limits.isolation, "cgroup": self._cgroup.version if self._cgroup else why_no_cgroup}
        try:
            argv, cwd, fds = self._command(main, files, boot_main)
            self._start = time.monotonic()
            self.process = subprocess.Popen(
                argv, cwd=cwd, env=self._environment(env), stdin=subprocess.PIPE, stdout=self._out,
                stderr=self._err, pass_fds=(*fds, *pass_fds, self._status.fileno(), self._info.fileno()),
                start_new_session=True)
        except BaseException:
            self._close_all()
            raise
        finally:
            for fd in self._cleanup_fds:
                os.close(fd)

    # -- the command ----------------------------------------------------------------

    def _command(self, main: str, files: dict[str, str], boot_main: bool) -> tuple[list[str], str, list[int]]:
        """(argv, cwd, descriptors the child needs): [cgroup join] [bwrap ...] python boot.py cfg."""
        seccomp = self._seccomp_programs()
        root = walls.STANDALONE if self._weak else walls.BOOT_DIR
        work, writable = (self._weak_workdir(files),) * 2 if self._weak else (walls.WORK_DIR, "/tmp")
        cfg = {
            "mode": self.limits.isolation, "uid": self._uid, "network": self.limits.network,
            "status_fd": self._status.fileno(), "seccomp_fds": [fd for fd, role in seccomp if role == "boot"],
            "cpu_s": max(1, int(self.limits.cpu_time_s)), "memory_bytes": int(self.limits.memory_mb * _MB),
            "nproc": self._nproc_limit(), "fsize_bytes": int(self.limits.max_file_mb * _MB),
            "writable_root": writable, "main": os.path.join(root if boot_main else work, main),
        }
        # -S: site-packages are added by the bootstrap without running their .pth hooks,
        # which cost more than the interpreter's own start on a loaded machine.
        argv = [os.path.realpath(sys.executable), "-I", "-S", os.path.join(root, "boot.py"), json.dumps(cfg)]
        fds = [fd for fd, _role in seccomp]
        cwd = work
        if not self._weak:
            bwrap_seccomp = next(fd for fd, role in seccomp if role == "bwrap")
            argv, cwd = self._bwrap_argv(files, bwrap_seccomp, fds) + ["--"] + argv, "/"
        if self._cgroup is not None:
            argv = ["/bin/sh", "-c", _JOIN_CGROUP, "sh", *self._cgroup.procs_files, "--", *argv]
        return argv, cwd, fds

    def _bwrap_argv(self, files: dict[str, str], seccomp_fd: int, fds: list[int]) -> list[str]:
        """bwrap and its flags (``walls``), with ``files`` copied into the working
        directory from in-memory descriptors (appended to ``fds``)."""
        file_flags = []
        for name, text in files.items():
            fd = _memfd(name, text.encode("utf-8"))
            self._cleanup_fds.append(fd)
            fds.append(fd)
            file_flags += ["--perms", "0644", "--file", str(fd), _inside(name)]
        as_root = os.geteuid() == 0
        return [walls.bwrap_path(), *walls.namespace_flags(self.limits.network, as_root),
                *walls.filesystem_flags(self.limits.disk_mb, self.limits.network), *file_flags,
                *walls.process_flags(as_root), "--seccomp", str(seccomp_fd), "--info-fd", str(self._info.fileno())]

    def _seccomp_programs(self) -> list[tuple[int, str]]:
        """(fd, who loads it): bwrap loads the allow-list, the bootstrap the no-exec stage.
        Weak mode: the bootstrap loads both when libseccomp is here, else none."""
        try:
            programs = [seccomp_policy.python_allowlist(self.limits.network), seccomp_policy.no_exec()]
        except seccomp_policy.SeccompUnavailable as err:
            if not self._weak:
                raise SandboxUnavailable(f"kernel sandbox unavailable: {err}. Or accept the weaker in-process "
                                         "sandbox explicitly: SandboxLimits(isolation='weak')") from err
            self._facts["seccomp"] = "none"
            return []
        self._facts["seccomp"] = "allow-list+no-exec"
        roles = ("boot", "boot") if self._weak else ("bwrap", "boot")
        out = []
        for program, role in zip(programs, roles):
            fd = _memfd("seccomp", program)
            self._cleanup_fds.append(fd)
            out.append((fd, role))
        return out

    def _weak_workdir(self, files: dict[str, str]) -> str:
        work = self._work = Path(tempfile.mkdtemp(prefix="asyncrl-sandbox-"))
        for name, text in files.items():
            path = (work / name).resolve()
            if work.resolve() not in path.parents:
                raise ValueError(f"sandbox file {name!r} escapes the working directory")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        if self._uid is not None:
            for path in [work, *work.rglob("*")]:
                os.chown(path, self._uid, self._uid)
        os.chmod(work, 0o700)
        return str(work)

    def _environment(self, extra: Optional[dict[str, str]]) -> dict[str, str]:
        home = walls.WORK_DIR if not self._weak else self._work
        env = {
            "PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": "/tmp" if not self._weak else str(home),
            "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            # one thread per BLAS/OpenMP pool: runs share the CPUs with the trainer
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        }
        return {**env, **(extra or {})}

    def _nproc_limit(self) -> int:
        """RLIMIT_NPROC counts the processes of the uid in its user namespace: a fresh
        uid (root callers) or a fresh user namespace (kernel mode) holds only this run.
        Weak mode with the caller's own uid: what the user already runs, plus ours."""
        if self._uid is not None or not self._weak:
            return self.limits.max_processes
        mine, running = os.getuid(), 0
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    running += entry.stat().st_uid == mine
                except OSError:
                    pass
        return running + self.limits.max_processes

    # -- running --------------------------------------------------------------------

    def wait(self, stdin: str = "") -> SandboxResult:
        """Feed stdin, wait for exit or the wall-clock deadline, kill what is left,
        and report. Always cleans up (cgroup, files, descriptors)."""
        fired = threading.Event()

        def on_deadline() -> None:
            fired.set()
            self.kill()

        deadline = threading.Timer(max(0.0, self.limits.wall_time_s - (time.monotonic() - self._start)), on_deadline)
        deadline.start()
        try:
            try:
                self.process.stdin.write(stdin.encode("utf-8", errors="replace"))
                self.process.stdin.close()
            except (BrokenPipeError, OSError):
                pass  # the program exited (or was killed) without reading its stdin
            # Wait without reaping: until reaped, the pid (= the group id) cannot be
            # reused, so the kill below cannot hit an unrelated group.
            os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT)
        finally:
            deadline.cancel()
            deadline.join()
            self.kill()
            self.process.wait()
        wall = time.monotonic() - self._start
        try:
            return self._result(fired.is_set(), wall)
        finally:
            self._close_all()

    def stop(self) -> None:
        """End the run because the caller is done with it (status "stopped")."""
        self._stopped = True
        self.kill()

    def kill(self) -> None:
        """SIGKILL the run. The sandbox's init (pid 1 of its PID namespace) goes first:
        its death ends every process of the namespace, and bwrap, its parent, reaps it
        and exits (killing bwrap first would leave the init to the host's pid 1 as a
        zombie). Then the whole process group, whatever is left."""
        init = self._sandbox_init()
        if init is not None and self._launcher_running():  # its child's pid cannot be reused yet
            try:
                os.kill(init, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + 1.0
            while self._launcher_running() and time.monotonic() < deadline:
                time.sleep(0.002)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _sandbox_init(self) -> Optional[int]:
        """The host pid of the namespace's init, from bwrap's --info-fd JSON."""
        if self._weak:
            return None
        try:
            info = json.loads(os.pread(self._info.fileno(), 4096, 0) or b"{}")
            return int(info["child-pid"]) if "child-pid" in info else None
        except (ValueError, OSError, TypeError):
            return None

    def _launcher_running(self) -> bool:
        try:
            return os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def _result(self, timed_out: bool, wall: float) -> SandboxResult:
        limit = self.limits.max_output_bytes
        stdout, stderr = _read(self._out, limit), _read(self._err, limit)
        status_line = _read(self._status, 64 * 1024).strip()
        try:
            isolation = {**json.loads(status_line), **self._facts} if status_line else {}
        except ValueError:
            isolation = {}
        if isolation:
            isolation.update(self._limit_facts())
        returncode = self.process.returncode
        if not self._weak and returncode is not None and returncode > 128:
            returncode = 128 - returncode  # bwrap reports a signal death as 128 + signal
        oom = self._cgroup is not None and self._cgroup.oom_killed()
        if self._stopped and isolation:
            status = "stopped"
        elif isolation or timed_out:
            status = _classify(returncode, timed_out, stderr, oom)
        else:  # no status line: the bootstrap failed before the program started
            status = "sandbox_error"
        return SandboxResult(status, returncode, stdout, stderr, wall, isolation)

    def _limit_facts(self) -> dict:
        limits, cg = self.limits, self._cgroup
        per_run = cg.version if cg else None
        return {
            "walls": "weak: audit hook" if self._weak else "bubblewrap",
            "memory": f"{per_run}: {limits.memory_mb} MB per run" if per_run else f"rlimit-as: {limits.memory_mb} MB per process",
            "processes": f"{per_run}: {limits.max_processes} per run" if per_run else f"rlimit-nproc: {self._nproc_limit()}",
            "cpu": f"{per_run}: {limits.cpus:g} CPU, rlimit-cpu {limits.cpu_time_s} s per process" if per_run
            else f"rlimit-cpu: {limits.cpu_time_s} s per process",
            "disk": f"tmpfs: {limits.disk_mb} MB per run" if not self._weak else f"rlimit-fsize: {limits.max_file_mb} MB per file",
        }

    def _close_all(self) -> None:
        if self._cgroup is not None:
            self._cgroup.close()
        elif self._weak and self._uid is not None:
            _kill_by_uid(self._uid)
        for fh in (self._out, self._err, self._status, self._info):
            fh.close()
        if self._work is not None:
            _remove(self._work)


def _inside(name: str) -> str:
    path = os.path.normpath(os.path.join(walls.WORK_DIR, name))
    if not path.startswith(walls.WORK_DIR + "/"):
        raise ValueError(f"sandbox file {name!r} escapes the working directory")
    return path


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, positioned at its start."""
    fd = os.memfd_create(f"asyncrl-{name}"[:200], 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _kill_by_uid(uid: int) -> None:
    """Weak mode without a PID namespace: children that called setsid() escaped the
    group; kill(-1) as the sandbox uid reaches exactly that uid's processes. Repeated
    because a fork bomb may fork between the scan and the signal."""
    for _ in range(3):
        subprocess.run(["kill", "-9", "-1"], user=uid, group=uid, extra_groups=[],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _read(fh, limit: int) -> str:
    fh.seek(0)
    data = fh.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n...[truncated]" if len(data) > limit else "")


def _classify(returncode: Optional[int], timed_out: bool, stderr: str, oom: bool) -> str:
    if timed_out:
        return "timeout"
    if oom:
        return "memory_limit"
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
