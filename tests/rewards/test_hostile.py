"""The hostile-program suite: every program contained and scored 0, nothing left outside.

The programs and what each attempts are in ``hostile_programs.py``. They run through
the code reward (sandbox + grader), two at a time; afterwards the host is searched for
anything they made (files, processes, sockets, listeners reached, cgroups). The suite
runs as the test's user (root on CI) and, when the tests run as root, again as an
unprivileged uid (``setpriv`` to nobody, with the system's Python).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import hostile_programs as hp

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"


def _host_dir() -> str:
    """A directory every uid can reach (pytest's tmp_path sits under a 0700 parent)."""
    path = tempfile.mkdtemp(prefix="asyncrl-hostile-")
    os.chmod(path, 0o777)
    return path


def _secret(host_dir: str, token: str, owner: int) -> str:
    path = os.path.join(host_dir, "secret")
    with open(path, "w") as fh:
        fh.write(f"SECRET-{token}")
    os.chown(path, owner, owner)
    os.chmod(path, 0o600)
    return path


def _check(records: list[dict], leaks: list[str], reached: list[str]) -> None:
    by_name = {r["name"]: r for r in records}
    assert set(by_name) == {p.name for p in hp.PROGRAMS}
    for record in records:
        assert record["score"] == 0.0, (record["name"], record["output"][-500:])
        assert record["forbidden_seen"] == [], (record["name"], record["output"][-1000:])
        assert record["status"] != "sandbox_error", record
        assert record["isolation"]["walls"] == "bubblewrap" and record["isolation"]["no_new_privs"]
    assert leaks == [] and reached == []
    # Evidence that the kernel, not the (disabled) audit hook, refused:
    kernel = by_name["privileges_and_kernel_calls"]["output"]
    assert "HOOK DISABLED True" in kernel and "CapEff:\t0000000000000000" in kernel and "Seccomp:\t2" in kernel
    syscalls = [line.split() for line in kernel.splitlines() if line.startswith("SYSCALL")]
    assert len(syscalls) == 8 and all(ret == "-1" and errno != "0" for _, _, ret, errno in syscalls), syscalls
    spawned = by_name["fork_exec_shell"]["output"]
    assert "fork_exec refused [Errno 1]" in spawned and "execv refused [Errno 1]" in spawned
    written = int(by_name["disk_fill"]["output"].split("WROTE_MB")[1].split()[0])
    assert written <= 32  # the run's tmpfs, although every file stayed under the 4 MB file limit
    memory = by_name["memory_across_processes"]
    if memory["isolation"]["memory"].startswith("cgroup"):  # 3 x 150 MB > 256 MB for the run
        assert "HELD 3" not in memory["output"]
    else:  # the named fallback: per-process limits only
        assert memory["isolation"]["memory"].startswith("rlimit-as")


@pytest.mark.usefixtures("kernel_sandbox")
def test_hostile_programs_are_contained_and_score_zero():
    token = f"tok{os.getpid()}x{time.monotonic_ns() % 10 ** 6}"
    host_dir = _host_dir()
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", f"{token}-canary"])
    abstract = f"asyncrl-listen-{token[::-1]}"
    sockets = hp.listeners(host_dir, abstract)
    try:
        port = sockets[0].getsockname()[1]
        records = hp.run_suite(host_dir, token, port, _secret(host_dir, token, os.getuid()), abstract)
        run_uids = {r["isolation"]["uid"] for r in records if r["isolation"].get("uid") not in (None, os.getuid())}
        leaks = hp.host_leaks(token, run_uids, port, [host_dir, "/tmp", "/dev/shm", "/var/tmp", os.getcwd()])
        _check(records, leaks, hp.reached(sockets))
    finally:
        canary.kill()
        for s in sockets:
            s.close()
        shutil.rmtree(host_dir, ignore_errors=True)


def _unprivileged_tree(into: str) -> None:
    """What the unprivileged run imports, readable by every uid: the package (no torch
    needed by asyncrl.rewards), pyseccomp (one file) and the suite."""
    import pyseccomp

    shutil.copytree(REPO / "asyncrl", Path(into) / "asyncrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(pyseccomp.__file__, into)
    shutil.copy(Path(__file__).with_name("hostile_programs.py"), into)
    for dirpath, dirs, files in os.walk(into):
        for name in dirs + files:
            os.chmod(os.path.join(dirpath, name), 0o755)
    os.chmod(into, 0o755)


@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the test above is the unprivileged run")
@pytest.mark.skipif(not (shutil.which("setpriv") and os.access(SYSTEM_PYTHON, os.X_OK)),
                    reason="needs setpriv and a system Python that an unprivileged uid can run")
@pytest.mark.usefixtures("kernel_sandbox")
def test_hostile_programs_as_an_unprivileged_user():
    nobody = 65534
    token = f"tok{os.getpid()}n{time.monotonic_ns() % 10 ** 6}"
    host_dir, tree = _host_dir(), tempfile.mkdtemp(prefix="asyncrl-unpriv-")
    try:
        _unprivileged_tree(tree)
        secret = _secret(host_dir, token, nobody)  # the user's own 0600 file: the run must not read it
        done = subprocess.run(
            ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups", SYSTEM_PYTHON,
             os.path.join(tree, "hostile_programs.py"), host_dir, token, secret],
            cwd=tree, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": tree, "HOME": host_dir},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300, check=False)
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        result = json.loads(done.stdout.decode().strip().splitlines()[-1])
        assert all(r["isolation"]["uid"] == nobody for r in result["records"])  # mapped to itself
        assert result["processes_left"] == []
        _check(result["records"], result["leaks"] + hp.host_leaks(token, {nobody}, 0, [host_dir, "/tmp"]),
               result["reached"])
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)
        shutil.rmtree(tree, ignore_errors=True)
