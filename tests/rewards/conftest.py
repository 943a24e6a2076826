"""Make the helper module ``reward_fixtures`` importable, also in pool worker processes
(they inherit sys.path from the test process)."""
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
