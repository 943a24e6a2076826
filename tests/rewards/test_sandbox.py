"""The sandbox contains hostile programs and the caller survives.

Limits are small so that the whole file runs in a few seconds.
"""
import os
import socket
import threading
import time

from asyncrl.rewards.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(wall_time_s=3.0, cpu_time_s=1, memory_mb=256, max_processes=8, max_file_mb=1)


def run(source, **kwargs):
    return run_python(source, limits=LIMITS, **kwargs)


def test_plain_program_runs_with_stdin_and_files():
    result = run("import helper\nprint(helper.twice(input()))",
                 stdin="21\n", files={"helper.py": "def twice(x):\n    return 2 * int(x)\n"})
    assert result.status == "ok" and result.stdout == "42\n"
    assert result.isolation["nproc"] >= 8 and result.isolation["audit_hook"]


def test_error_is_reported_not_raised():
    result = run("raise ValueError('boom')")
    assert result.status == "error" and "ValueError: boom" in result.stderr


def test_infinite_loop_hits_the_cpu_limit():
    assert run("while True:\n    pass").status == "cpu_limit"


def test_sleeping_forever_hits_the_wall_time():
    result = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_time_s=0.5))
    assert result.status == "timeout" and result.wall_s < 3


def test_memory_bomb_is_contained():
    result = run("x = bytearray(2 * 1024 ** 3)")
    assert result.status == "memory_limit"


def test_huge_file_write_is_capped():
    result = run("with open('big', 'wb') as f:\n    f.write(b'x' * 8 * 1024 * 1024)")
    assert result.status in ("error", "file_limit") and "File too large" in result.stderr


def test_huge_stdout_is_capped():
    result = run("while True:\n    print('x' * 10000)")
    assert result.status != "ok" and len(result.stdout) < 100_000


def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run(bomb)
    assert result.status in ("timeout", "cpu_limit", "killed")
    if os.geteuid() == 0:  # every process of the sandbox uid is gone (the kernel
        uid = result.isolation["uid"]  # reaps a dead PID namespace asynchronously)
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


def test_writing_outside_the_temp_dir_is_refused(tmp_path):
    target = tmp_path / "pwned"
    for source in (f"open({str(target)!r}, 'w').write('x')",
                   f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                   f"import os\nos.mkdir({str(tmp_path / 'd')!r})"):
        result = run(source)
        assert result.status == "error" and "PermissionError" in result.stderr
    assert not target.exists() and not (tmp_path / "d").exists()


def test_temp_dir_is_removed_even_when_made_unwritable():
    result = run("import os\nos.mkdir('d')\nopen('d/f', 'w').write('x')\nos.chmod('d', 0)\nprint(os.getcwd())")
    assert result.status == "ok"
    assert not os.path.exists(result.stdout.strip())


def test_network_is_blocked():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    finally:
        server.close()
    assert result.status == "error" and "network access is disabled" in result.stderr
    assert result.isolation["network"] in ("ns:netns", "userns+ns:netns", "audit-hook")


def test_signalling_the_caller_is_contained():
    """The caller is out of reach: a PID namespace hides it, the audit hook refuses
    any process outside the sandbox's group, and a foreign uid could not anyway."""
    me, my_group = os.getpid(), os.getpgid(0)
    for source in (f"import os, signal\nos.kill({me}, signal.SIGTERM)",
                   f"import os, signal\nos.killpg({my_group}, signal.SIGTERM)",
                   "import os, signal\nos.kill(-1, signal.SIGKILL)"):
        result = run(source)
        assert result.status == "error", source
        assert "sandbox:" in result.stderr or "ProcessLookupError" in result.stderr, source
    assert os.getpid() == me  # still here


def test_multiprocessing_inside_the_sandbox_works():
    source = ("import multiprocessing as mp\n"
              "def square(x):\n    return x * x\n"
              "if __name__ == '__main__':\n"
              "    with mp.get_context('fork').Pool(2) as pool:\n"
              "        print(sum(pool.map(square, range(10))))\n")
    result = run_python(source, limits=SandboxLimits(wall_time_s=10, memory_mb=512))
    assert result.status == "ok" and result.stdout == "285\n", result.stderr


def test_starting_programs_and_ctypes_are_refused():
    for source in ("import subprocess\nsubprocess.run(['true'])",
                   "import os\nos.system('true')",
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
