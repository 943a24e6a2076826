"""Named errors: failures whose message already says what broke and what to do.

The CLI prints an :class:`AsyncRLError` as one line (``asyncrl: error: <message>``) and writes
the full traceback to the run directory's ``error.log`` (or a temp file when no run directory
survives), so a user sees the cause, not a wall of frames. Leaf module: it imports nothing
from the package, so any layer may raise these.
"""
from __future__ import annotations


class AsyncRLError(Exception):
    """Base of the named errors; the message is a complete sentence naming the cause."""


class CheckpointError(AsyncRLError):
    """A checkpoint could not be written or read (the previous complete one is kept)."""


class RunDirError(AsyncRLError):
    """The run directory cannot be created, is locked by another run, or holds a run that
    this one would overwrite."""


class ModelLoadError(AsyncRLError):
    """``model.path`` (or a checkpoint) is not a loadable model: missing or corrupt files."""


class NonFiniteError(AsyncRLError):
    """Parameters became NaN/Inf after an optimizer step; nothing poisoned was saved."""


class SkippedStepsError(AsyncRLError):
    """Too many consecutive steps skipped their update (non-finite loss or gradient)."""


class HangError(AsyncRLError, TimeoutError):
    """A wait (rollout process, weight channel, collective, rollout data) passed its time limit;
    the message names what was waited for."""


class Preempted(AsyncRLError):
    """SIGTERM/SIGINT arrived before the first step: nothing was trained, nothing to resume."""
