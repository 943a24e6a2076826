"""Per-run cgroups: limits written, processes killed and directories removed on close."""
import os
import subprocess
import time

import pytest

from asyncrl.rewards.cgroup import PREFIX, RunCgroup


@pytest.fixture
def run_cgroup():
    cgroup, why = RunCgroup.create(64 * 1024 * 1024, 5, 0.5)
    if cgroup is None:
        pytest.skip(f"no writable cgroup here: {why}")
    yield cgroup
    cgroup.close()


def _read(directory, name):
    with open(os.path.join(directory, name)) as fh:
        return fh.read().strip()


def test_limits_are_written(run_cgroup):
    values = {}
    for d in run_cgroup.dirs:
        for name in ("memory.max", "memory.limit_in_bytes", "pids.max", "cpu.max", "cpu.cfs_quota_us"):
            if os.path.exists(os.path.join(d, name)):
                values[name] = _read(d, name)
    assert values.get("memory.max", values.get("memory.limit_in_bytes")) == str(64 * 1024 * 1024)
    assert values["pids.max"] == "5"
    assert values.get("cpu.max", "50000 100000") == "50000 100000" and values.get("cpu.cfs_quota_us", "50000") == "50000"
    assert all(os.path.basename(d).startswith(f"{PREFIX}{os.getpid()}-") for d in run_cgroup.dirs)


def test_close_kills_what_is_inside_and_removes_it(run_cgroup):
    join = " ".join(f"echo $$ > {p};" for p in run_cgroup.procs_files)
    child = subprocess.Popen(["/bin/sh", "-c", f"{join} exec sleep 60"])
    deadline = time.monotonic() + 10
    while not run_cgroup.pids() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run_cgroup.pids() == [child.pid]
    dirs = list(run_cgroup.dirs)
    run_cgroup.close()
    assert child.wait(timeout=10) == -9
    assert not any(os.path.exists(d) for d in dirs)
