"""Each rank of a multi-rank run logs to its own file, ``<run_dir>/logs/rank_<r>.log``.

Ranks other than 0 send everything they print there (their stdout and stderr file
descriptors, so C++ warnings and a dying rank's traceback land in it too). Rank 0 keeps the
terminal (progress bar, tables) and copies its stderr (warnings, errors) into its file.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


class _Tee:
    """A text stream writing to two streams (the terminal and the log file)."""

    def __init__(self, primary, copy):
        self.primary, self.copy = primary, copy

    def write(self, text: str) -> int:
        self.copy.write(text)
        self.copy.flush()
        return self.primary.write(text)

    def flush(self) -> None:
        self.primary.flush()
        self.copy.flush()

    def __getattr__(self, name):
        return getattr(self.primary, name)


def rank_log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank_{rank}.log"


def open_rank_log(run_dir: Path, rank: int) -> Path:
    """Route this rank's output to its log file (see module doc); returns the path."""
    path = rank_log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "a", buffering=1)
    stream.write(f"rank {rank} (pid {os.getpid()})\n")
    if rank == 0:
        sys.stderr = _Tee(sys.stderr, stream)
        return path
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stream.fileno(), 1)
    os.dup2(stream.fileno(), 2)
    return path
