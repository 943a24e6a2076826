"""Where a failed job's traceback goes, so the console can show one line.

The console gets ``asyncrl: error: <message>`` (a named error's message already says what
broke and what to do); the full traceback goes to ``<run_dir>/error.log``, or to a file in
the system's temp directory when the job failed before its run directory held anything
(run_dir.py then removes the directory: no empty run dirs). ``failure_log(err)`` tells the
CLI where it is.
"""
from __future__ import annotations

import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

ERROR_LOG = "error.log"


def write_traceback(err: BaseException, run_dir: Optional[Path] = None) -> Path:
    """Append ``err``'s traceback to ``run_dir/error.log`` (or a new temp file); the path is
    remembered on ``err`` for :func:`failure_log`."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    if run_dir is not None and Path(run_dir).is_dir():
        path = Path(run_dir) / ERROR_LOG
        with open(path, "a") as f:
            f.write(f"--- {stamp}\n{text}")
    else:
        with tempfile.NamedTemporaryFile("w", prefix="asyncrl-error-", suffix=".log", delete=False) as f:
            f.write(f"--- {stamp}\n{text}")
            path = Path(f.name)
    try:
        err.asyncrl_log = path
    except AttributeError:  # an exception type with __slots__
        pass
    return path


def failure_log(err: BaseException) -> Optional[Path]:
    """Where :func:`write_traceback` put ``err``'s traceback, if it did."""
    return getattr(err, "asyncrl_log", None)


def one_line(err: BaseException) -> str:
    """The first line of the message (a child's traceback in a message stays in the log)."""
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
