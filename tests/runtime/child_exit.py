"""How a test checks that a rollout process stopped cleanly.

The proof is the child's answer to "stop", sent after its workers and weight channel closed
(``RolloutProcess.stopped_cleanly``), then its exit code. A forkserver child's exit code travels
through the fork server; when that server is gone before it reported the code (CPython's
forkserver dies under load, python/cpython#140867), multiprocessing reads 255. So a 255 passes
only while that server is really gone: with the server running, a 255 is the child's own."""
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
    process = backend.process
    assert backend.stopped_cleanly, f"the child did not answer 'stop' (exit code {process.exitcode})"
    assert not process.is_alive()
    if process.exitcode == 255:
        server = forkserver._forkserver._forkserver_pid
        assert not _running(server), f"exit code 255 while the fork server (pid {server}) runs: the child's own"
    else:
        assert process.exitcode == 0
