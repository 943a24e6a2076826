"""Run directories: created atomically, locked against a second writer, removed when a run
fails before writing anything, and an unwritable one named."""
import os
import subprocess
import sys
import threading

import pytest

from asyncrl.errors import RunDirError
from asyncrl.runtime import run_dir as rd


def _cfg(tmp_path, run_dir=None):
    from asyncrl.config import load_config

    extra = [f"logging.run_dir={run_dir}"] if run_dir else []
    return load_config(None, [f"logging.output_dir={tmp_path}", *extra])


def test_runs_started_in_the_same_second_get_distinct_directories(tmp_path, monkeypatch):
    """16 threads create the same <time>-<name>: each gets its own directory (exists-check then
    mkdir(exist_ok=True) gave two runs one directory in 3 of 17 trials)."""
    monkeypatch.setattr(rd.time, "strftime", lambda fmt: "20261201-120000")
    made, barrier = [], threading.Barrier(16)

    def make():
        barrier.wait()
        made.append(rd._new_dir(tmp_path, "20261201-120000-run")[0])
    threads = [threading.Thread(target=make) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == 16 and all(p.is_dir() for p in made)


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(run / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n"
        "print('locked', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"in use by another run \\(pid {holder.pid}\\)"):
            rd.make_run_dir(_cfg(tmp_path, run))
    finally:
        holder.kill()
        holder.wait()
    path = rd.make_run_dir(_cfg(tmp_path, run))  # the lock died with its holder (even by SIGKILL)
    assert rd.run_dir_is_held(path)
    rd.release_run_dir(path)


def test_a_run_that_fails_before_its_first_step_leaves_no_directory(tmp_path, capsys):
    from asyncrl.cli import main

    rc = main(["train", "quickstart", f"logging.output_dir={tmp_path}", "model.path=" + str(tmp_path),
               "trainer.steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "is neither an HF model directory" in err.strip().splitlines()[-1]
    assert list(tmp_path.iterdir()) == []  # no empty <time>-quickstart directory


def test_an_unwritable_run_dir_is_named(tmp_path):
    if os.geteuid() == 0:  # root writes anywhere: use a path under a file instead
        blocker = tmp_path / "file"
        blocker.write_text("")
        target = blocker / "run"
    else:
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        target = locked / "run"
    with pytest.raises(RunDirError, match=f"cannot create run directory {target}"):
        rd.make_run_dir(_cfg(tmp_path, target))


def test_discard_keeps_directories_with_results(tmp_path):
    path = rd.make_run_dir(_cfg(tmp_path, tmp_path / "kept"))
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not rd.discard_if_unused(path) and path.is_dir()
    assert not rd.discard_if_unused(tmp_path / "never-held")  # not created by this process
