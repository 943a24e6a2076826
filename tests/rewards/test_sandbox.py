"""The sandbox: what a run sees and may do, its limits, and its refusal where the
kernel sandbox is missing. (The hostile-program suite is test_hostile.py.)

Limits are small so that the whole file runs in a few seconds.
"""
import logging
import os
import socket
import threading
import time

import pytest

import hostile_programs
from asyncrl.rewards import sandbox as sandbox_module
from asyncrl.rewards.sandbox import SandboxLimits, SandboxUnavailable, run_python

LIMITS = SandboxLimits(wall_time_s=3.0, cpu_time_s=1, memory_mb=256, max_processes=8, max_file_mb=1, disk_mb=16)
pytestmark = pytest.mark.usefixtures("kernel_sandbox")


def run(source, **kwargs):
    return run_python(source, limits=LIMITS, **kwargs)


def test_plain_program_runs_with_stdin_and_files():
    result = run("import helper\nprint(helper.twice(input()))",
                 stdin="21\n", files={"helper.py": "def twice(x):\n    return 2 * int(x)\n"})
    assert result.status == "ok" and result.stdout == "42\n"
    iso = result.isolation
    assert iso["walls"] == "bubblewrap" and iso["mode"] == "kernel" and iso["network"] == "netns"
    assert iso["capabilities"] == "0000000000000000" and iso["no_new_privs"] and iso["seccomp_filters"] == 2
    assert iso["disk"] == "tmpfs: 16 MB per run"
    if os.geteuid() == 0:  # a throw-away uid per run
        assert iso["uid"] >= 1_000_000


def test_the_run_sees_only_its_own_root():
    """A private root: /usr and the Python installation read-only, one writable tmpfs.
    The audit hook is disabled first, so the kernel answers."""
    source = hostile_programs.DISABLE_HOOK + (
              "import os\nprint(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/proc'))[:3])\n"
              "for path in ('/usr/x', '/x', '/etc/x'):\n    try:\n        open(path, 'w')\n"
              "    except OSError as e:\n        print(path, e.errno)\n"
              "open('/tmp/a', 'w').write('1')\nopen('/dev/shm/b', 'w').write('2')\nprint(sorted(os.listdir('/tmp')))\n")
    result = run(source)
    assert result.status == "ok", result.stderr
    lines = result.stdout.splitlines()[1:]  # after "HOOK DISABLED True"
    assert "home" not in lines[0] and "work" not in lines[0] and "'proc'" in lines[0]
    assert eval(lines[1])[0] in ("1", "2")  # a fresh PID namespace: the run's own processes only
    assert [line.split()[1] for line in lines[2:5]] == ["30"] * 3, lines  # EROFS: read-only everywhere
    assert eval(lines[5]) == ["a", "b", "work"]  # /dev/shm is the same tmpfs as /tmp
    assert not os.path.exists("/tmp/a") or open("/tmp/a").read() != "1"


def test_error_is_reported_not_raised():
    result = run("raise ValueError('boom')")
    assert result.status == "error" and "ValueError: boom" in result.stderr


def test_infinite_loop_hits_the_cpu_limit():
    # a generous wall time: on a loaded shared machine 1 CPU second can take many
    limits = SandboxLimits(wall_time_s=30.0, cpu_time_s=1, memory_mb=256)
    assert run_python("while True:\n    pass", limits=limits).status == "cpu_limit"


def test_sleeping_forever_hits_the_wall_time():
    result = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_time_s=0.5))
    assert result.status == "timeout" and result.wall_s < 3


def test_memory_bomb_is_contained():
    assert run("x = bytearray(2 * 1024 ** 3)").status == "memory_limit"


def test_huge_file_write_is_capped():
    result = run("with open('big', 'wb') as f:\n    f.write(b'x' * 8 * 1024 * 1024)")
    assert result.status in ("error", "file_limit") and "File too large" in result.stderr


def test_huge_stdout_is_capped():
    result = run("while True:\n    print('x' * 10000)")
    assert result.status != "ok" and len(result.stdout) < 100_000


def test_fork_bomb_is_contained_and_leaves_nothing():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run(bomb)
    assert result.status in ("timeout", "cpu_limit", "killed")
    if os.geteuid() == 0:  # every process of the run's uid is gone
        uid = result.isolation["uid"]
        deadline = time.monotonic() + 10
        while _processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_of(uid) == []


def _processes_of(uid):
    return [p for p in os.listdir("/proc") if p.isdigit() and _uid_of(p) == uid]


def _uid_of(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def test_host_files_are_out_of_reach(tmp_path):
    target = tmp_path / "pwned"
    for source in (f"open({str(target)!r}, 'w').write('x')",
                   f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                   f"import os\nos.mkdir({str(tmp_path / 'd')!r})"):
        result = run(source)
        assert result.status == "error" and ("PermissionError" in result.stderr or "FileNotFoundError" in result.stderr)
    assert not target.exists() and not (tmp_path / "d").exists()


def test_network_is_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
    assert result.status == "error" and "network access is disabled" in result.stderr
    assert result.isolation["network"] == "netns"


def test_signalling_the_caller_is_contained():
    me, my_group = os.getpid(), os.getpgid(0)
    for source in (f"import os, signal\nos.kill({me}, signal.SIGTERM)",
                   f"import os, signal\nos.killpg({my_group}, signal.SIGTERM)",
                   "import os, signal\nos.kill(-1, signal.SIGKILL)"):
        result = run(source)
        assert result.status == "error", source
    assert os.getpid() == me  # still here


def test_multiprocessing_fork_works_inside_the_sandbox():
    """The fork context works; spawn/forkserver start a new interpreter, which the
    no-exec filter refuses."""
    source = ("import multiprocessing as mp\n"
              "def square(x):\n    return x * x\n"
              "if __name__ == '__main__':\n"
              "    with mp.get_context('fork').Pool(2) as pool:\n"
              "        print(sum(pool.map(square, range(10))))\n")
    result = run_python(source, limits=SandboxLimits(wall_time_s=10, memory_mb=512))
    assert result.status == "ok" and result.stdout == "285\n", result.stderr


def test_starting_programs_and_ctypes_are_refused():
    for source in ("import subprocess\nsubprocess.run(['true'])", "import os\nos.system('true')",
                   "import ctypes\nctypes.CDLL(None)"):
        result = run(source)
        assert result.status == "error" and "sandbox:" in result.stderr, source


def test_concurrent_runs_from_threads():
    results = [None] * 4

    def work(i):
        results[i] = run(f"print({i} * 2)")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout for r in results] == ["0\n", "2\n", "4\n", "6\n"]


def test_missing_kernel_sandbox_is_a_loud_named_refusal(monkeypatch):
    monkeypatch.setattr(sandbox_module.walls, "probe", lambda network=False: "bubblewrap is not installed")
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed.*isolation='weak'"):
        run_python("print(1)")
    weak = run_python("print(1)", limits=SandboxLimits(isolation="weak"))  # accepted explicitly
    assert weak.status == "ok" and weak.stdout == "1\n"
    assert weak.isolation["mode"] == "weak" and weak.isolation["walls"] == "weak: audit hook"


def test_without_a_cgroup_the_fallback_is_named(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module.RunCgroup, "create", classmethod(lambda cls, *a, **k: (None, "no delegation")))
    monkeypatch.setattr(sandbox_module, "_cgroup_warned", threading.Event())
    with caplog.at_level(logging.WARNING, logger="asyncrl.rewards.sandbox"):
        result = run("print(1)")
    assert result.status == "ok"
    assert result.isolation["memory"] == "rlimit-as: 256 MB per process"
    assert result.isolation["cgroup"] == "no delegation" and "no delegation" in caplog.text


def test_isolation_mode_is_validated():
    with pytest.raises(ValueError, match="isolation"):
        SandboxLimits(isolation="none")


def test_closed_to_others_names_the_directory_that_stops_a_foreign_uid():
    """The weak sandbox's throw-away uid must reach asyncrl's standalone scripts: a directory on
    the way without others-execute (a home of mode 700), or a script without others-read, is named.
    (Not under pytest's tmp_path: its root is itself mode 700.)"""
    import tempfile
    from pathlib import Path

    from asyncrl.rewards import walls

    with tempfile.TemporaryDirectory(dir="/tmp") as base:
        home = Path(base) / "home"
        (home / "pkg").mkdir(parents=True)
        script = home / "pkg" / "boot.py"
        script.write_text("pass\n")
        for directory in (Path(base), home, home / "pkg"):
            directory.chmod(0o755)
        script.chmod(0o644)
        assert walls.closed_to_others(str(script)) == ""
        home.chmod(0o700)
        assert walls.closed_to_others(str(script)) == f"{home} (mode drwx------)"
        home.chmod(0o711)  # enterable, not listable: enough
        assert walls.closed_to_others(str(script)) == ""
        script.chmod(0o600)
        assert walls.closed_to_others(str(script)) == f"{script} (mode -rw-------)"
