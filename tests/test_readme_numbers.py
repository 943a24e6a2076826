"""The quickstart numbers README.md and docs/async.md quote are what ``asyncrl train`` gives.

- The docs' blocks are exactly what bench/readme_numbers.py renders from
  bench/results/readme_numbers.json (the script is the only way to change them).
- CI's own quickstart run (the session's ``quickstart_run``: seed 0, an empty warm-start cache,
  as a newcomer runs it) starts from the same warm start and gains within the tolerance the
  README states: 3 standard deviations of the gain over the seeds measured, at least 3 binomial
  standard errors of the eval; skipped only when the wall-clock cap cut RL below 80% of the
  README's steps.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "bench" / "readme_numbers.py")
readme_numbers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_numbers)


def _numbers() -> dict:
    return json.loads(readme_numbers.JSON_PATH.read_text())


def test_the_docs_quote_the_measured_numbers():
    numbers = _numbers()
    assert "sync" in numbers["runs"] and numbers["runs"]["sync"][0]["seed"] == 0
    assert readme_numbers.check(numbers) == []


def test_the_check_catches_an_edited_number(tmp_path, monkeypatch):
    numbers = _numbers()
    edited = json.loads(json.dumps(numbers))
    edited["runs"]["sync"][0]["final_sampled_accuracy"] += 0.01
    assert readme_numbers.check(edited) and readme_numbers.check(numbers) == []


def test_tolerance_hand_values():
    # one seed: 3 binomial standard errors, 3 * sqrt(0.5 * 0.5 / 800) = 0.0530
    assert readme_numbers.tolerance([0.5], 0.5, 800) == pytest.approx(3 * math.sqrt(0.25 / 800))
    # seeds 0.4, 0.5, 0.6: sd 0.1 -> 0.3 beats the binomial 0.106 of n = 200
    assert readme_numbers.tolerance([0.4, 0.5, 0.6], 0.5, 200) == pytest.approx(0.3)


@pytest.mark.slow
def test_a_newcomers_quickstart_reproduces_the_readme_numbers(quickstart_run):
    _, summary = quickstart_run
    sync = _numbers()["runs"]["sync"]
    reference = sync[0]
    n = {"accuracy": readme_numbers.HELDOUT, "sampled_accuracy": readme_numbers.HELDOUT
         * readme_numbers.SAMPLES_PER_PROBLEM}
    for key in ("accuracy", "sampled_accuracy"):  # the warm start: same seed, same recipe
        before = reference[f"sft_{key}"]
        assert abs(summary[f"sft_{key}"] - before) <= readme_numbers.tolerance([r[f"sft_{key}"] for r in sync],
                                                                              before, n[key]), key
    if summary["steps"] < 0.8 * reference["steps"]:  # trainer.max_wall_seconds cut RL much shorter
        pytest.skip(f"this run made {summary['steps']} RL steps (trainer.max_wall_seconds on a busy machine), the README "
                    f"quotes {reference['steps']} steps")
    for key in ("accuracy", "sampled_accuracy"):
        gains = [r[f"final_{key}"] - r[f"sft_{key}"] for r in sync]
        tol = readme_numbers.tolerance(gains, reference[f"final_{key}"], n[key])
        gain = summary[f"final_{key}"] - summary[f"sft_{key}"]
        assert abs(gain - gains[0]) <= tol, (key, gain, gains[0], tol)
