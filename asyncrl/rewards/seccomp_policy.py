"""The sandbox's seccomp filters, compiled to BPF with libseccomp (``pyseccomp``).

Two stages, both allow-lists or deny-lists over system-call *numbers* that the kernel
checks on every call, whatever the program does to its own interpreter:

  * ``python_allowlist()``: what CPython and its usual extension modules need (files,
    memory, threads, fork, pipes, signals, timers, epoll, Unix sockets). Everything else
    fails with EPERM: ptrace, mount, unshare/setns, bpf, perf_event_open, keyctl,
    io_uring, userfaultfd, kernel modules, clock setting, reboot, ... ``clone`` is allowed
    only without namespace flags; ``clone3`` (whose flags the filter cannot read) answers
    ENOSYS so the C library falls back to ``clone``; ``socket`` is allowed for AF_UNIX
    only (plus AF_INET/AF_INET6 when the network is allowed). ``ioctl`` is open: the
    sandbox has no terminal to push input into (a new session, no tty devices, stdio are
    pipes and files). bubblewrap loads this filter just before it starts the interpreter
    (``bwrap --seccomp FD``).
  * ``no_exec()``: execve/execveat refused. The bootstrap loads it after the interpreter
    has started and before the program runs, so the program can start no other binary.

Why libseccomp through ``pyseccomp``: libseccomp is the library Docker, systemd and
podman build their filters with; it resolves syscall names per architecture, adds the
architecture check, and optimises the BPF. ``pyseccomp`` is a pure-Python ctypes
binding with the API of libseccomp's own Python bindings, so it installs from PyPI
without a compiler (Debian's ``python3-seccomp`` only serves the system interpreter).
The filters are built once per process and cached as bytes.
"""
from __future__ import annotations

import errno
import functools
import os

# CPython's needs, from strace of the interpreter running the test programs
# (multiprocessing fork and spawn, threads, tempfile, signals, numpy, sqlite, asyncio)
# plus their close relatives, cross-checked with Docker's default profile.
ALLOWED = """
read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 lseek close close_range
open openat openat2 creat access faccessat faccessat2 stat lstat fstat newfstatat statx fstatfs statfs
readlink readlinkat getdents getdents64 getcwd chdir fchdir
mkdir mkdirat rmdir unlink unlinkat rename renameat renameat2 link linkat symlink symlinkat
chmod fchmod fchmodat fchown fchownat lchown chown umask utime utimes utimensat futimesat
truncate ftruncate fallocate fadvise64 fsync fdatasync sync_file_range flock
dup dup2 dup3 fcntl pipe pipe2 sendfile copy_file_range splice tee
mmap munmap mprotect mremap madvise brk msync mincore mlock munlock mlock2 mlockall munlockall
get_mempolicy set_mempolicy mbind membarrier
rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending rt_sigsuspend rt_sigtimedwait rt_sigqueueinfo
rt_tgsigqueueinfo sigaltstack kill tkill tgkill pause alarm
getitimer setitimer timer_create timer_settime timer_gettime timer_getoverrun timer_delete
timerfd_create timerfd_settime timerfd_gettime eventfd eventfd2 signalfd signalfd4
nanosleep clock_nanosleep clock_gettime clock_getres gettimeofday time times
select pselect6 poll ppoll epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2
futex futex_waitv set_robust_list get_robust_list set_tid_address rseq arch_prctl
fork vfork wait4 waitid exit exit_group
getpid getppid gettid getpgrp getpgid setpgid getsid setsid
getuid geteuid getgid getegid getgroups getresuid getresgid
setuid setgid setreuid setregid setresuid setresgid setgroups setfsuid setfsgid
capget prctl seccomp
uname sysinfo getrlimit setrlimit prlimit64 getrusage getpriority setpriority
sched_yield sched_getaffinity sched_setaffinity sched_getparam sched_getscheduler
sched_get_priority_max sched_get_priority_min sched_rr_get_interval getcpu
getrandom memfd_create
socketpair connect bind listen accept accept4 shutdown sendto recvfrom sendmsg recvmsg sendmmsg
recvmmsg getsockname getpeername getsockopt setsockopt
inotify_init inotify_init1 inotify_add_watch inotify_rm_watch
ioprio_get ioctl
execve
""".split()

# clone flags that create namespaces: a sandboxed program must not make new ones
# (a new user namespace hands it a full capability set inside).
CLONE_NAMESPACES = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
                    | 0x20000000 | 0x40000000 | 0x00000080)  # NEWNS UTS IPC USER PID NET CGROUP TIME
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10


class SeccompUnavailable(RuntimeError):
    """libseccomp or its Python binding is missing: the kernel sandbox cannot filter."""


def _seccomp():
    try:
        import pyseccomp
    except (ImportError, RuntimeError) as err:  # RuntimeError: the binding found no libseccomp.so
        raise SeccompUnavailable(
            f"seccomp filters need libseccomp and the 'pyseccomp' package ({err}); "
            "pip install pyseccomp and apt-get install libseccomp2") from err
    return pyseccomp


def _export(flt) -> bytes:
    """The filter as a BPF program, the format ``bwrap --seccomp`` and prctl load."""
    fd = os.memfd_create("asyncrl-seccomp")
    with os.fdopen(fd, "w+b") as fh:
        flt.export_bpf(fh)
        fh.seek(0)
        return fh.read()


def _allow(sc, flt, name: str, *args) -> None:
    try:
        flt.add_rule(sc.ALLOW, name, *args)
    except OSError:
        pass  # no such system call on this architecture (e.g. "open" on aarch64)


@functools.lru_cache(maxsize=2)
def python_allowlist(allow_network: bool = False) -> bytes:
    """Stage one (see the module docstring) as BPF bytes."""
    sc = _seccomp()
    flt = sc.SyscallFilter(defaction=sc.ERRNO(errno.EPERM))
    for name in ALLOWED:
        _allow(sc, flt, name)
    _allow(sc, flt, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NAMESPACES, 0))
    try:
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    except OSError:
        pass
    families = (AF_UNIX, AF_INET, AF_INET6) if allow_network else (AF_UNIX,)
    for family in families:
        _allow(sc, flt, "socket", sc.Arg(0, sc.EQ, family))
    return _export(flt)


@functools.lru_cache(maxsize=1)
def no_exec() -> bytes:
    """Stage two: execve and execveat refused, everything else left to stage one."""
    sc = _seccomp()
    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    for name in ("execve", "execveat"):
        flt.add_rule(sc.ERRNO(errno.EPERM), name)
    return _export(flt)
