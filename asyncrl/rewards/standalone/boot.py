"""Sandbox bootstrap: the first Python that runs inside a sandbox, before untrusted code.

Started as ``python -I boot.py '<json config>'`` by ``asyncrl.rewards.sandbox``, either
inside bubblewrap's walls (``mode == "kernel"``) or, when the caller accepted the weaker
sandbox explicitly, directly (``mode == "weak"``). Standard library only: it must not
import asyncrl or torch. In order, it:

  1. (weak mode only) enters new PID and network namespaces where the kernel allows
     (``unshare``, via a user namespace for unprivileged callers) and forks under a
     reaping init, as the sandbox did before bubblewrap;
  2. when the config names a uid (the caller is root): empties the capability
     bounding set, switches to the uid, and clears what capabilities are left (the
     three bubblewrap kept for this step);
  3. sets resource limits, hard = soft so they cannot be raised: CPU seconds, address
     space, processes, file size, no core dumps;
  4. loads the seccomp filters (kernel mode: the no-exec stage, bubblewrap loaded the
     allow-list; weak mode: both, when the parent could build them);
  5. writes what it observes (uid, capabilities, no-new-privileges, seccomp mode) as
     one JSON line to the status descriptor and closes it: the program never holds a
     channel to the parent other than its stdio (or the request pipes of the server);
  6. installs the audit hook (PEP 578) as a second line: it refuses, from Python,
     writes outside the writable root, non-Unix sockets, signals outside the run,
     starting programs, and ctypes;
  7. runs ``main`` as ``__main__`` (a user program, or the candidate server).
"""
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def _libc():
    # dlopen(NULL): the C library the interpreter is linked with. (ctypes.util.find_library
    # runs ldconfig or a compiler: a third of a second, and a program started.)
    return ctypes.CDLL(None, use_errno=True)


def load_seccomp(bpf: bytes) -> None:
    """Install one BPF filter (as built by libseccomp's export) on this process."""
    count = len(bpf) // ctypes.sizeof(SockFilter)
    program = (SockFilter * count).from_buffer_copy(bpf)
    fprog = SockFprog(count, ctypes.cast(program, ctypes.POINTER(SockFilter)))
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def isolate_weak(allow_network: bool) -> dict:
    """Weak mode: new PID and (unless allowed) network namespaces, whichever the kernel grants."""
    libc = _libc()
    net = 0 if allow_network else CLONE_NEWNET
    for flags, how in ((CLONE_NEWPID | net, "ns"), (CLONE_NEWUSER | CLONE_NEWPID | net, "userns+ns"),
                       (net, "ns"), (CLONE_NEWUSER | net, "userns+ns")):
        if flags and libc.unshare(flags) == 0:
            return {"network": "allowed" if allow_network else f"{how}:netns",
                    "pid_namespace": bool(flags & CLONE_NEWPID)}
    return {"network": "allowed" if allow_network else "audit-hook", "pid_namespace": False}


def supervise() -> None:
    """Weak mode: fork into the new PID namespace; return only in the program's process.

    outer boot (our parent's child)  waits for ns init, then dies the way the program died
      ns init (pid 1 in the namespace)  reaps orphans until the program exits
        program                         returns from this function
    pid 1 of a namespace cannot die by its own non-KILL signals, so it reports a
    signal death as exit code 128 + signal and the outer boot re-raises it.
    """
    init = os.fork()
    if init:
        _, status = os.waitpid(init, 0)
        code = os.waitstatus_to_exitcode(status)
        if code > 128:
            signal.signal(code - 128, signal.SIG_DFL)
            os.kill(os.getpid(), code - 128)
        os._exit(code if code >= 0 else 128 - code)
    program = os.fork()
    if program == 0:
        return
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if pid == program:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


PR_CAPBSET_DROP = 24
CAP_LAST = 63


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def clear_capabilities(bounding: bool) -> None:
    """Empty the bounding set (needs CAP_SETPCAP, so before the uid change) or the
    effective/permitted/inheritable sets (after it, when nothing is left to lose)."""
    libc = _libc()
    if bounding:
        for cap in range(CAP_LAST + 1):
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the kernel's last cap
        return
    header = CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    libc.capset(ctypes.byref(header), ctypes.byref((CapData * 2)()))


def drop_privileges(uid: int, keep_paths: bool) -> None:
    """Become ``uid``. With ``keep_paths`` (weak mode, where the Python installation may
    sit under a directory the uid cannot traverse, e.g. /root), sys.path entries become
    ``/proc/self/fd/N`` descriptors opened while still root; inside bubblewrap's root
    every bound path is traversable and nothing needs moving."""
    if keep_paths:
        moved = {}
        for entry in sys.path:
            if entry and os.path.isdir(entry):
                moved[entry] = f"/proc/self/fd/{os.open(entry, os.O_RDONLY | os.O_DIRECTORY)}"
        sys.path[:] = [moved.get(entry, entry) for entry in sys.path]
        for module in list(sys.modules.values()):  # packages already imported keep their own __path__
            paths = getattr(module, "__path__", None)
            if isinstance(paths, list):
                paths[:] = [_relocate(p, moved) for p in paths]
        sys.path_importer_cache.clear()
    clear_capabilities(bounding=True)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    clear_capabilities(bounding=False)
    if keep_paths:  # /proc/self/fd must stay ours after the uid change
        _libc().prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def _relocate(path: str, moved: dict) -> str:
    for old, new in moved.items():
        if path == old or path.startswith(old + "/"):
            return new + path[len(old):]
    return path


def set_limits(cfg: dict) -> None:
    def cap(which, value):
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    # CPU: the soft limit sends SIGXCPU; the hard limit one second later is SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    cap(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
    cap(resource.RLIMIT_NPROC, cfg["nproc"])
    cap(resource.RLIMIT_AS, cfg["memory_bytes"])


def observed() -> dict:
    """What the kernel says about this process now."""
    status = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    return {"uid": os.getuid(), "capabilities": status.get("CapEff", "?"),
            "no_new_privs": status.get("NoNewPrivs") == "1",
            "seccomp_filters": int(status.get("Seccomp_filters", "0") or 0)}


def make_audit_hook(root: str, allow_network: bool):
    """The PEP 578 hook: raise PermissionError for the events the sandbox forbids."""
    # Everything the hook uses is bound here: __main__'s globals are cleared before
    # the program runs, and the program must not be able to swap them out.
    root = os.path.realpath(root)
    realpath, getpgid, fspath = os.path.realpath, os.getpgid, os.fspath
    own_group = os.getpgid(0)
    isinstance_, str_, bytes_, int_, any_ = isinstance, str, bytes, int, any
    write_flags = WRITE_FLAGS
    path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
                   "os.chmod", "os.chown", "os.truncate", "os.utime", "shutil.rmtree",
                   "shutil.copyfile", "shutil.move", "os.mkfifo", "os.mknod"}
    exec_events = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "os.fork_exec", "pty.spawn", "os.startfile"}

    def inside(path) -> bool:
        if isinstance_(path, int_):
            return True  # an already-open descriptor
        if isinstance_(path, bytes_):
            path = path.decode(errors="replace")
        if not isinstance_(path, str_):
            path = fspath(path)
        full = realpath(path)
        return full == root or full.startswith(root + "/") or full == "/dev/null"

    def may_signal(target: int, is_group: bool) -> bool:
        """Only the sandbox's own process group; -1 ("everything I may signal") never."""
        if target == -1:
            return False
        if target == 0:
            return True
        if is_group or target < 0:
            return abs(target) == own_group
        try:
            return getpgid(target) == own_group
        except OSError:
            return True  # no such process: the kill itself fails

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any_(c in mode for c in "wax+")) or (
                mode is None and isinstance_(flags, int_) and flags & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory: {path!r}")
        elif event in path_events:
            for path in args[:2]:
                if isinstance_(path, (str_, bytes_)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} outside the working directory: {path!r}")
        elif event.startswith("socket.") and not allow_network:
            if event == "socket.__new__" and args[1] == 1:  # AF_UNIX: local only
                return
            raise PermissionError(f"sandbox: network access is disabled ({event})")
        elif event in ("os.kill", "os.killpg"):
            if not may_signal(args[0], event == "os.killpg"):
                raise PermissionError(f"sandbox: signalling processes outside the sandbox is disabled ({event})")
        elif event in exec_events:
            raise PermissionError(f"sandbox: starting programs is disabled ({event})")
        elif event.startswith("ctypes."):
            raise PermissionError(f"sandbox: ctypes is disabled ({event})")

    return hook


def run_main(path: str, boot_dir: str) -> None:
    """Run ``path`` as ``__main__`` in a clean module namespace (no bootstrap helpers)."""
    with open(path, encoding="utf-8") as fh:
        source = fh.read()
    code = compile(source, os.path.basename(path), "exec")
    sys.argv = [os.path.basename(path)]
    sys.path[:] = [p for p in sys.path if p != boot_dir]
    sys.path.insert(0, os.path.dirname(path) if os.path.dirname(path) != boot_dir else os.getcwd())
    fresh = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": path}
    # This file is __main__ itself: clearing its namespace removes the bootstrap's
    # helpers from the program's view (the audit hook keeps its own references).
    main_dict = sys.modules["__main__"].__dict__
    main_dict.clear()
    main_dict.update(fresh)
    exec(code, main_dict)


def add_site_packages() -> None:
    """The installation's site-packages on sys.path, as ``site`` would put them, but
    without executing .pth files (started with -S: they are slow, and run code)."""
    import site

    sys.path.extend(p for p in site.getsitepackages() if os.path.isdir(p) and p not in sys.path)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    add_site_packages()
    # stdout/stderr are files: line buffering keeps what a killed program printed
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if cfg["mode"] == "weak":
        facts = isolate_weak(cfg["network"])
        if facts["pid_namespace"]:
            supervise()
    else:
        facts = {"network": "allowed" if cfg["network"] else "netns", "pid_namespace": True}
    if cfg["uid"] is not None:
        drop_privileges(cfg["uid"], keep_paths=cfg["mode"] == "weak")
    set_limits(cfg)
    for fd in cfg["seccomp_fds"]:  # BPF programs, in order, on inherited descriptors
        with os.fdopen(fd, "rb") as fh:
            load_seccomp(fh.read())
    with os.fdopen(cfg["status_fd"], "w") as status:  # closed before any untrusted code runs
        status.write(json.dumps({**facts, **observed()}) + "\n")
    sys.addaudithook(make_audit_hook(cfg["writable_root"], cfg["network"]))
    del cfg["status_fd"]
    run_main(cfg["main"], os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    main()
