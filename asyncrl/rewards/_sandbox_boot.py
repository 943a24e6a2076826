"""Sandbox bootstrap: runs *inside* the sandboxed interpreter, before the untrusted code.

Started by ``asyncrl.rewards.sandbox`` as ``python -I _sandbox_boot.py '<json config>'``
with the isolated temporary directory as working directory. Standard library only
(it must not import asyncrl or torch). In order, it:

  1. enters new PID and network namespaces (``unshare``; unprivileged users try a user
     namespace too): no network interface but a downed loopback, and when the program
     ends the kernel kills and reaps everything it started; if refused, step 5 still
     blocks sockets from Python;
  2. when started as root, switches to the throw-away uid
     the parent chose: root is exempt from RLIMIT_NPROC, and a plain uid cannot
     signal the parent or write to root-owned paths;
  3. sets resource limits (hard = soft, so the program cannot raise them): CPU time,
     address space, process count, file size, no core dumps;
  4. writes what it enforced as one JSON line to the report fd;
  5. installs an audit hook (PEP 578) that refuses, from Python: non-Unix sockets,
     writing/removing/renaming files outside the working directory, signalling
     processes outside the sandbox's process group, starting programs (subprocess, exec, spawn, system: a new interpreter
     would not carry the hook) and ctypes (which could bypass the hook);
  6. runs ``main.py`` as ``__main__``.
"""
import ctypes
import ctypes.util
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def isolate(allow_network: bool) -> dict:
    """Enter new PID and (unless allowed) network namespaces, whichever the kernel grants.

    Tries as-is (root), then inside a new user namespace (unprivileged users), then
    the network alone. The PID namespace is what makes cleanup exact: when its first
    process exits, the kernel kills and reaps every process left inside.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    net = 0 if allow_network else CLONE_NEWNET
    for flags, how in ((CLONE_NEWPID | net, "ns"), (CLONE_NEWUSER | CLONE_NEWPID | net, "userns+ns"),
                       (net, "ns"), (CLONE_NEWUSER | net, "userns+ns")):
        if flags and libc.unshare(flags) == 0:
            return {"network": "allowed" if allow_network else f"{how}:netns",
                    "pid_namespace": bool(flags & CLONE_NEWPID)}
    return {"network": "allowed" if allow_network else "audit-hook", "pid_namespace": False}


def supervise() -> None:
    """Fork into the new PID namespace; return only in the process that runs the program.

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


PR_SET_DUMPABLE = 4


def drop_privileges(uid: int) -> None:
    """Become ``uid`` while keeping the Python installation importable.

    The sandbox uid may not be allowed to traverse to the installation (e.g. under
    /root, mode 700). Directory descriptors opened now, as root, stay usable:
    sys.path entries become ``/proc/self/fd/N``, which resolve without checking the
    ancestors' permissions. The process must stay dumpable for /proc/self to be its.
    """
    moved = {}
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            moved[entry] = f"/proc/self/fd/{os.open(entry, os.O_RDONLY | os.O_DIRECTORY)}"
    sys.path[:] = [moved.get(entry, entry) for entry in sys.path]
    # Packages imported already (encodings, collections...) find submodules through
    # their own __path__, which still names the old location.
    for module in list(sys.modules.values()):
        paths = getattr(module, "__path__", None)
        if isinstance(paths, list):
            paths[:] = [_relocate(p, moved) for p in paths]
    sys.path_importer_cache.clear()
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def _relocate(path: str, moved: dict) -> str:
    for old, new in moved.items():
        if path == old or path.startswith(old + "/"):
            return new + path[len(old):]
    return path


def set_limits(cfg: dict) -> None:
    def cap(which, value):
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    # CPU: soft limit sends SIGXCPU; the hard limit one second later is SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    cap(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
    cap(resource.RLIMIT_NPROC, cfg["nproc"])
    cap(resource.RLIMIT_AS, cfg["memory_bytes"])


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
                   "shutil.copyfile", "shutil.move"}
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
        """Only the sandbox's own process group: the program and what it forked
        (multiprocessing terminates its workers). The caller is never in it;
        -1 ("every process I may signal") is refused outright."""
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


def main() -> None:
    cfg = json.loads(sys.argv[1])
    report = os.fdopen(cfg["report_fd"], "w", buffering=1, closefd=False)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    isolation = isolate(cfg["network"])
    if isolation["pid_namespace"]:
        supervise()
    sys.path.insert(0, os.getcwd())  # the program may import its sibling files
    if cfg["uid"] is not None:
        drop_privileges(cfg["uid"])
    with open("main.py", encoding="utf-8") as fh:
        source = fh.read()
    set_limits(cfg)
    report.write(json.dumps({
        **isolation, "uid": os.getuid(), "cpu_s": cfg["cpu_s"],
        "memory_bytes": cfg["memory_bytes"], "nproc": cfg["nproc"],
        "fsize_bytes": cfg["fsize_bytes"], "audit_hook": True,
    }) + "\n")
    sys.addaudithook(make_audit_hook(os.getcwd(), cfg["network"]))
    sys.argv = ["main.py"]
    del cfg, report
    code = compile(source, "main.py", "exec")
    main_globals = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "main.py"}
    # Run in a clean __main__ so the program does not see the bootstrap's helpers.
    main_dict = sys.modules["__main__"].__dict__
    main_dict.clear()
    main_dict.update(main_globals)
    exec(code, main_dict)


if __name__ == "__main__":
    main()
