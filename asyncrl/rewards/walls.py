"""The kernel's walls around a sandboxed run, built with bubblewrap (``bwrap``).

bubblewrap (Debian/Ubuntu/Fedora package ``bubblewrap``; Flatpak's sandbox) sets up
namespaces and mounts and then executes the interpreter; it is a few hundred lines of
audited C that does exactly this job, where doing it from Python would re-implement
it. What the run sees:

  * a new root (a read-only tmpfs) holding only ``/usr`` (and the /bin, /lib, ...
    links or binds of this host), the Python installation, a few /etc files the C
    library reads, and ``/.asyncrl`` (the bootstrap scripts), all read-only;
  * one tmpfs of ``disk_mb`` at ``/tmp`` that holds every writable byte: the working
    directory ``/tmp/work``, and ``/var/tmp`` and ``/dev/shm`` as links into it;
  * a private ``/proc`` (a new PID namespace: only the run's own processes), a minimal
    read-only ``/dev`` (null, zero, full, random, urandom);
  * new user (unprivileged callers), PID, network (no interface but a downed
    loopback), IPC, UTS and cgroup namespaces; no further user namespaces inside;
  * no capabilities, no-new-privileges, a new session (no controlling terminal), the
    seccomp allow-list of ``seccomp_policy``, and death with its parent.

A root caller starts bwrap as root so that the interpreter can switch to a throw-away
uid (only CAP_SETUID/SETGID/SETPCAP are kept, and the bootstrap drops them with the uid):
the run then owns no file on the host and shares its uid with nothing. An unprivileged
caller gets the same walls through an unprivileged user namespace.

``probe()`` runs bwrap once per process with the same namespaces and reports why the
kernel or the host refuses, so the sandbox can refuse loudly instead of running weaker.
"""
from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Optional

BOOT_DIR = "/.asyncrl"  # where the standalone scripts appear inside the sandbox
WORK_DIR = "/tmp/work"
STANDALONE = str(Path(__file__).with_name("standalone"))
# Files the C library reads, bound read-only when present (name resolution only when
# the run may use the network). Nothing else of /etc: not even the user list.
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_ETC_NETWORK = ("/etc/hosts", "/etc/resolv.conf", "/etc/nsswitch.conf", "/etc/ssl")
_ROOT_ENTRIES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_DEVICES = ("null", "zero", "full", "random", "urandom")


class SandboxUnavailable(RuntimeError):
    """The kernel sandbox cannot run here; the message names the cause and the switch
    (``SandboxLimits(isolation="weak")``) that accepts the weaker in-process sandbox."""


def bwrap_path() -> Optional[str]:
    return shutil.which("bwrap", path=os.environ.get("PATH", "") + ":/usr/bin:/bin")


def python_roots() -> list[str]:
    """The directories the interpreter needs: its installation and any virtualenv."""
    roots = []
    for path in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))):
        real = os.path.realpath(path)
        if real.startswith("/usr/") or real == "/usr":
            continue
        if not any(real == r or real.startswith(r + "/") for r in roots):
            roots.append(real)
    return roots


def namespace_flags(network: bool, as_root: bool) -> list[str]:
    flags = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        flags.append("--unshare-net")
    if not as_root:  # the unprivileged way in; root keeps the host user namespace and drops its uid
        flags += ["--unshare-user", "--disable-userns"]
    return flags


def filesystem_flags(disk_mb: int, network: bool = False) -> list[str]:
    """The mounts listed in the module docstring, in bwrap's order of application."""
    flags = ["--ro-bind", "/usr", "/usr"]
    for entry in _ROOT_ENTRIES:
        host = f"/{entry}"
        if os.path.islink(host):
            flags += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            flags += ["--ro-bind", host, host]
    made: set[str] = set()
    for root in python_roots():
        flags += _traversable_parents(root, made) + ["--ro-bind", root, root]
    for path in _ETC_FILES + (_ETC_NETWORK if network else ()):
        if os.path.exists(path):
            flags += _traversable_parents(path, made) + ["--ro-bind", os.path.realpath(path), path]
    flags += ["--ro-bind", STANDALONE, BOOT_DIR, "--proc", "/proc",
              "--size", str(64 * 1024), "--perms", "0755", "--tmpfs", "/dev"]
    for device in _DEVICES:
        flags += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    flags += ["--symlink", "/proc/self/fd", "/dev/fd", "--symlink", "/proc/self/fd/0", "/dev/stdin",
              "--symlink", "/proc/self/fd/1", "/dev/stdout", "--symlink", "/proc/self/fd/2", "/dev/stderr",
              "--symlink", "/tmp", "/dev/shm", "--remount-ro", "/dev",
              "--size", str(disk_mb * 1024 * 1024), "--perms", "1777", "--tmpfs", "/tmp",
              "--perms", "0777", "--dir", WORK_DIR,
              "--perms", "0755", "--dir", "/var", "--symlink", "/tmp", "/var/tmp"]
    return flags


def _traversable_parents(path: str, made: set[str]) -> list[str]:
    """bwrap makes missing parents of a mount point 0700; the run's uid must traverse
    them (/root, ~/.pyenv, /etc ...): make them 0755 first."""
    flags = []
    for parent in reversed(Path(path).parents[:-1]):
        if str(parent) not in made:
            made.add(str(parent))
            flags += ["--perms", "0755", "--dir", str(parent)]
    return flags


def process_flags(as_root: bool) -> list[str]:
    flags = ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL",
             "--chdir", WORK_DIR, "--remount-ro", "/"]
    if as_root:  # the bootstrap's uid change and bounding-set drop; all gone after it
        flags += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    return flags


@functools.lru_cache(maxsize=4)
def probe(network: bool = False) -> str:
    """"" when bwrap can build these walls here, else the reason it cannot."""
    bwrap = bwrap_path()
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap / dnf install bubblewrap)"
    as_root = os.geteuid() == 0
    argv = [bwrap, *namespace_flags(network, as_root), *filesystem_flags(1, network), *process_flags(as_root),
            "--", sys.executable, "-I", "-S", "-c", "pass"]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bubblewrap could not run: {err}"
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip().splitlines()
        hint = ""
        if not as_root:
            hint = (" (unprivileged user namespaces may be disabled: sysctl kernel.unprivileged_userns_clone, "
                    "user.max_user_namespaces, or an AppArmor restriction)")
        return f"bubblewrap failed: {message[-1] if message else done.returncode}{hint}"
    return ""


def closed_to_others(path: str) -> str:
    """"" when a uid that owns nothing (the weak sandbox's throw-away one) can reach and read
    ``path``, else the first component that stops it: a directory on the way without the
    others-execute bit, or the path itself without others-read (e.g. a checkout under a home
    directory of mode 700)."""
    parts = Path(os.path.abspath(path)).parts
    for depth in range(1, len(parts) + 1):
        here = os.path.join(*parts[:depth])
        try:
            mode = os.stat(here).st_mode
        except OSError as err:
            return f"{here}: {err.strerror}"
        last = depth == len(parts)
        need = (stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)) if last else stat.S_IXOTH
        if mode & need != need:
            return f"{here} (mode {stat.filemode(mode)})"
    return ""


@functools.lru_cache(maxsize=None)
def weak_mode_blocker(script: str) -> str:
    """Why the weak sandbox's throw-away uid (a root caller's runs) could not read the standalone
    ``script`` it runs as its main program, or "": the bootstrap starts as the caller and opens
    that script only after the switch (the interpreter and the bootstrap itself need no such access)."""
    return closed_to_others(os.path.join(STANDALONE, script))
