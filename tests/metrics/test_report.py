"""``asyncrl report``: renders from a synthetic run directory; every image loads in headless Chromium.

The browser test needs Debian's chromium (``apt-get install -y chromium``); it is skipped,
saying so, where no chromium binary is on PATH.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from asyncrl.metrics.report import REPORT_NAME, load_run, main, write_report
from asyncrl.metrics.report_plots import available

from .run_fixture import make_run_dir

# Plot-drawing tests; the rest (tables, CLI, the no-matplotlib page) run without it.
pytestmark_plots = pytest.mark.skipif(not available(), reason="the report's plots need matplotlib "
                                                               "(pip install 'asyncrl[report]')")

PLOTS = ("held-out accuracy", "train reward", "KL", "entropy", "response length", "stage time stacked area",
         "throughput")


def _img_alts(page: str) -> list[str]:
    return re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,', page)


@pytestmark_plots
def test_report_renders_sync_run(tmp_path):
    run_dir = make_run_dir(tmp_path)
    path = write_report(run_dir)
    assert path == run_dir / REPORT_NAME
    page = path.read_text()
    alts = _img_alts(page)
    for alt in PLOTS + ("health timeline",):
        assert alt in alts
    assert "staleness" not in alts  # synchronous: no staleness data...
    assert "not applicable: synchronous run" in page  # ...and the page says why
    assert "if 5x faster" in page and "rollout is" in page  # Amdahl table and headline
    assert "kl_budget" in page and "nonfinite" in page  # health events table (from health_events.jsonl)
    # what a user looks for comes first: accuracy, then the profile, then health, then the rest
    order = [page.index(f"<h2>{h}</h2>") for h in ("Held-out accuracy and reward", "Stage profile", "Health",
                                                     "Sampled completions", "KL")]
    assert order == sorted(order)
    assert "0.400 -&gt; 0.550 (+15.0 points)" in page and "0.250 -&gt; 0.500 (+25.0 points)" in page
    assert "reward gain per 1k samples" in page
    assert "http://" not in page and "https://" not in page  # self-contained: nothing fetched


@pytestmark_plots
def test_report_renders_async_run_with_staleness(tmp_path):
    page = write_report(make_run_dir(tmp_path, async_run=True)).read_text()
    assert "staleness" in _img_alts(page)
    assert "async overlap" in page and "async runtime" in page


def test_report_without_summary_or_events_replays_health(tmp_path):
    run_dir = make_run_dir(tmp_path)
    (run_dir / "summary.json").unlink()
    (run_dir / "health_events.jsonl").unlink()
    run = load_run(run_dir)
    assert run.events_replayed and {e.monitor for e in run.events} == {"kl_budget", "nonfinite"}
    page = write_report(run_dir).read_text()
    assert "run in progress or interrupted" in page
    assert "monitors replayed over metrics.jsonl" in page and "kl_budget" in page


def test_report_without_matplotlib_keeps_the_tables(tmp_path, monkeypatch):
    from asyncrl.metrics import report_plots

    monkeypatch.setattr(report_plots, "available", lambda: False)
    page = write_report(make_run_dir(tmp_path)).read_text()
    assert _img_alts(page) == []
    assert "matplotlib is not installed" in page and "if 5x faster" in page


def test_load_run_reads_nan_rows(tmp_path):
    run = load_run(make_run_dir(tmp_path))
    assert run.rows[11]["actor/pg_loss"] == "nan"  # what the JSONL sink writes for NaN
    assert {e.monitor for e in run.events} == {"kl_budget", "nonfinite"}


def test_main_cli(tmp_path, capsys):
    run_dir = make_run_dir(tmp_path)
    out = tmp_path / "r.html"
    assert main([str(run_dir), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert main([str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err


CHECK_SCRIPT = """<script>
window.addEventListener('load', () => {
  const result = [...document.images].map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight]);
  const pre = document.createElement('pre');
  pre.id = 'imgcheck';
  pre.textContent = JSON.stringify(result);
  document.body.appendChild(pre);
});
</script>"""

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--virtual-time-budget=10000")


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def _image_check(page: str, tmp_path) -> list:
    """[alt, complete, naturalWidth, naturalHeight] of each image of ``page``, as Chromium loaded it."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium on PATH: apt-get update && apt-get install -y chromium")
    # A copy with a script that, once every image has loaded or failed, writes each image's
    # natural size into the DOM, which --dump-dom then prints. The report itself has no script.
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", CHECK_SCRIPT + "</body>"))
    profile = tmp_path / "chromium-profile"
    done = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", probe.as_uri()],
                          capture_output=True, text=True, timeout=120)
    match = re.search(r'<pre id="imgcheck">(.*?)</pre>', done.stdout, re.S)
    assert match, f"no image check in the DOM; chromium rc={done.returncode}, stderr tail: {done.stderr[-2000:]}"
    return json.loads(match.group(1))


def _broken(images: list) -> list[str]:
    return [alt for alt, complete, width, height in images if not (complete and width > 0 and height > 0)]


@pytestmark_plots
def test_every_image_loads_in_headless_chromium(tmp_path):
    page = write_report(make_run_dir(tmp_path, async_run=True)).read_text()
    expected = _img_alts(page)
    images = _image_check(page, tmp_path)
    assert [alt for alt, *_ in images] == expected and len(expected) >= 8
    assert _broken(images) == []


def test_browser_check_catches_a_broken_image(tmp_path):
    """The check is not vacuous: a corrupt PNG has naturalWidth 0."""
    page = '<html><body><img alt="bad" src="data:image/png;base64,iVBORw0KGgoAAAA="></body></html>'
    assert _broken(_image_check(page, tmp_path)) == ["bad"]
