"""The seccomp filters, loaded for real by a child interpreter (as the bootstrap does)."""
import json
import subprocess
import sys

import pytest

from asyncrl.rewards import walls

seccomp_policy = pytest.importorskip("asyncrl.rewards.seccomp_policy")

CHILD = r'''
import ctypes, errno, json, os, socket, sys
sys.path.insert(0, sys.argv[1])
from boot import load_seccomp
libc = ctypes.CDLL(None, use_errno=True)
load_seccomp(bytes.fromhex(sys.argv[2]))
load_seccomp(bytes.fromhex(sys.argv[3]))
out = {}
def attempt(name, call):
    try:
        value = call()
        out[name] = "ok" if value != -1 else errno.errorcode[ctypes.get_errno()]
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
attempt("unix_socket", lambda: socket.socket(socket.AF_UNIX).close())
attempt("inet_socket", lambda: socket.socket(socket.AF_INET).close())
attempt("unshare_user", lambda: libc.unshare(0x10000000))
attempt("mount", lambda: libc.mount(b"none", b"/mnt", b"tmpfs", 0, None))
attempt("ptrace", lambda: libc.ptrace(0, 0, 0, 0))
attempt("exec", lambda: os.execv("/bin/true", ["true"]))
attempt("fork", lambda: os.waitpid(os.fork() or os._exit(0), 0))  # the child leaves at once
attempt("read_file", lambda: open(sys.argv[1] + "/boot.py").read(10))
print(json.dumps(out))
'''


def test_allow_list_and_no_exec_hold_in_the_kernel():
    try:
        allow, no_exec = seccomp_policy.python_allowlist(), seccomp_policy.no_exec()
    except seccomp_policy.SeccompUnavailable as err:
        pytest.skip(str(err))
    assert len(allow) % 8 == 0 and len(no_exec) % 8 == 0  # sock_filter records
    done = subprocess.run([sys.executable, "-I", "-S", "-c", CHILD,
                           walls.STANDALONE, allow.hex(), no_exec.hex()],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result = json.loads(done.stdout.decode().splitlines()[-1])
    assert result == {"unix_socket": "ok", "inet_socket": "EPERM", "unshare_user": "EPERM", "mount": "EPERM",
                      "ptrace": "EPERM", "exec": "EPERM", "fork": "ok", "read_file": "ok"}
