"""Screenshots of report pages in headless Chromium (Debian's ``chromium``), for the docs.

    python bench/report_screenshots.py RUN_DIR:docs/images/report_sync.png RUN_DIR2:docs/images/report_async.png

Each RUN_DIR's report is (re)rendered with ``asyncrl report`` first, then Chromium takes a
screenshot of its first ``--height`` pixels (what a reader sees on opening it: accuracy,
reward, profile, health).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from asyncrl.metrics.report import write_report

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def screenshot(page: Path, png: Path, width: int, height: int) -> None:
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                   None)
    if browser is None:
        raise SystemExit("no chromium on PATH: apt-get install -y chromium")
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                        f"--screenshot={png.resolve()}", page.resolve().as_uri()], check=True, capture_output=True,
                       timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+", metavar="RUN_DIR:PNG")
    parser.add_argument("--width", type=int, default=1100)
    parser.add_argument("--height", type=int, default=2200)
    args = parser.parse_args()
    for pair in args.pairs:
        run_dir, png = pair.rsplit(":", 1)
        screenshot(write_report(Path(run_dir)), Path(png), args.width, args.height)
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
