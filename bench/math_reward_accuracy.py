"""Math reward on every reference file in ../shared/data: accuracy and time per call.

    python bench/math_reward_accuracy.py [--json PATH]

For each row the reference solution (or the answer written as a model would) must score
1 against the reference answer, and the answer plus one must score 0 (numeric answers).
Reports, per file, the accuracy of both checks and the p50 / p99 / max seconds per call,
wall and CPU (parse + compare of the response, one process, main thread: the budget of
0.5 CPU-seconds applies)
with the reference already parsed, as for the G samples of a group; the reference's own
parse (once per prompt, cached, outside the budget: it is trusted data) is reported
apart. Then the same for adversarial answers that used to take seconds. Exits non-zero
unless every row is right.
The 2-core machine is shared: the load average is printed with the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from asyncrl.eval.answers import last_boxed
from asyncrl.rewards.math import _gold_text, _parse_gold, extract_gsm8k, math_reward

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PATHOLOGICAL = ["\\boxed{(10!)!}", "\\boxed{10^{10^{10}}}", "\\boxed{9^{9^{9^9}}}", "\\boxed{(10^{100})!}",
                "\\boxed{100000!}", "\\boxed{x^{10^{12}}}", "\\boxed{" + "(" * 200 + "1" + ")" * 200 + "}",
                "\\boxed{" + "1+" * 2000 + "1}", "\\boxed{\\sum_{k=1}^{10^{12}} k}"]


def rows(name: str) -> list[dict]:
    with open(DATA / name, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def cases(name: str):
    """(response, gold, expected score) triples for one file."""
    for row in rows(name):
        if name.startswith("gsm8k"):
            answer = extract_gsm8k(row["answer"])
            yield row["answer"], answer, 1.0
            yield row["answer"].rsplit("####", 1)[0] + f"#### {int(float(answer)) + 1}", answer, 0.0
        elif "minerva" in name:
            yield row["solution"], last_boxed(row["solution"]), 1.0
        else:
            answer = row["answer"]
            yield f"The answer is $\\boxed{{{answer}}}$.", answer, 1.0
            yield f"The answer is $\\boxed{{{float(answer) + 1:g}}}$.", answer, 0.0


def timed(response: str, gold) -> tuple[float, float, float]:
    """(score, wall seconds, CPU seconds) of one call."""
    start, cpu = time.perf_counter(), time.process_time()
    score = math_reward("", response, answer=gold)
    return score, time.perf_counter() - start, time.process_time() - cpu


def gold_parse_seconds(gold) -> float:
    """The reference's parse alone (cold); afterwards it is cached."""
    start = time.perf_counter()
    _parse_gold(_gold_text(gold))
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    timed("\\boxed{1}", "1")  # imports and warm-up outside the numbers
    report = {"date": time.strftime("%Y-%m-%d"), "load_before": os.getloadavg()[0], "files": {}}
    all_right = True
    for name in ("gsm8k/train.jsonl", "gsm8k/test.jsonl", "math_eval/aime24.jsonl", "math_eval/amc23.jsonl",
                 "math_eval/minerva_math.jsonl"):
        triples = list(cases(name))
        gold_seconds = [gold_parse_seconds(gold) for gold in dict.fromkeys(str(g) for _, g, _ in triples)]
        results = [(timed(response, gold), want) for response, gold, want in triples]
        seconds = [s for (_, s, _), _ in results]
        cpu = [c for (_, _, c), _ in results]
        wrong = sum(score != want for (score, _, _), want in results)
        all_right &= wrong == 0
        report["files"][name] = {"calls": len(results), "wrong": wrong, "p50_s": percentile(seconds, 0.5),
                                 "p99_s": percentile(seconds, 0.99), "max_s": max(seconds),
                                 "p99_cpu_s": percentile(cpu, 0.99), "max_cpu_s": max(cpu),
                                 "reference_parse_p99_s": percentile(gold_seconds, 0.99),
                                 "reference_parse_max_s": max(gold_seconds)}
        print(name, report["files"][name], flush=True)
    adversarial = [timed(r, "5") for r in PATHOLOGICAL]
    report["pathological"] = {"answers": [a[:40] for a in PATHOLOGICAL], "scores": [s for s, _, _ in adversarial],
                              "seconds": [t for _, t, _ in adversarial], "max_s": max(t for _, t, _ in adversarial),
                              "cpu_seconds": [c for _, _, c in adversarial], "max_cpu_s": max(c for _, _, c in adversarial)}
    report["load_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all_right and not any(report["pathological"]["scores"]) else 1


if __name__ == "__main__":
    sys.exit(main())
