"""Make the helper modules (``reward_fixtures``, ``hostile_programs``) importable, also in
pool worker processes (they inherit sys.path from the test process); and the
``kernel_sandbox`` fixture."""
import os
import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="session")
def kernel_sandbox():
    """Skip where bubblewrap cannot build the sandbox (a developer machine without it),
    naming why; in CI (CI=true, which installs bubblewrap) that is a failure instead."""
    from asyncrl.rewards import walls

    why = walls.probe()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the kernel sandbox: {why}")
        pytest.skip(why)
