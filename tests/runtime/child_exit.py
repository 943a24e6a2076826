"""How a test checks that a rollout process stopped cleanly.

The proof is the child's answer to "stop", sent after its workers and weight channel closed
(``RolloutProcess.stopped_cleanly``), then its exit code, read under the child's lock
(``RolloutProcess.exitcode``). Why the lock: a forkserver child's exit code is read from a pipe,
and two threads reading it at once (close() joining while the receiver thread joined on EOF)
made one of them read EOF, which multiprocessing records as 255 (CPython gh-130895): CI saw that
255 twice. A 255 still passes if the fork server itself is gone (it then never wrote the code,
python/cpython#140867); with the server running, a 255 is the child's own and fails."""
import multiprocessing.forkserver as forkserver


def _running(pid) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError, TypeError):
        return False


def assert_stopped_cleanly(backend) -> None:
    """``backend`` (a closed ``RolloutProcess``) answered "stop" and exited 0 (or its exit code
    was lost with its fork server, see the module doc)."""
    code = backend.exitcode
    assert backend.stopped_cleanly, f"the child did not answer 'stop' (exit code {code})"
    assert code is not None, "the child is still running"
    if code == 255:
        server = forkserver._forkserver._forkserver_pid
        assert not _running(server), f"exit code 255 while the fork server (pid {server}) runs: the child's own"
    else:
        assert code == 0
