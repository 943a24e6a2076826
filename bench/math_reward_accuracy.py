"""Math reward on every reference file in ../shared/data: accuracy and time per call.

    python bench/math_reward_accuracy.py [--json PATH]

For each row the reference solution (or the answer written as a model would) must score
1 against the reference answer, and the answer plus one must score 0 (numeric answers).
Reports, per file, the accuracy of both checks and the p50 / p99 / max seconds per call
(parse + compare, one process, main thread: the 0.5 s budget applies), then the same for
adversarial answers that used to take seconds. Exits non-zero unless every row is right.
The 2-core machine is shared: the load average is printed with the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from asyncrl.rewards.math import extract_gsm8k, math_reward

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PATHOLOGICAL = ["\\boxed{(10!)!}", "\\boxed{10^{10^{10}}}", "\\boxed{9^{9^{9^9}}}", "\\boxed{(10^{100})!}",
                "\\boxed{100000!}", "\\boxed{x^{10^{12}}}", "\\boxed{" + "(" * 200 + "1" + ")" * 200 + "}",
                "\\boxed{" + "1+" * 2000 + "1}", "\\boxed{\\sum_{k=1}^{10^{12}} k}"]


def rows(name: str) -> list[dict]:
    with open(DATA / name, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def last_boxed(text: str) -> str:
    start = text.rindex("\\boxed{") + len("\\boxed{")
    depth, end = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        end += 1
    return text[start:end - 1]


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


def timed(response: str, gold) -> tuple[float, float]:
    start = time.perf_counter()
    score = math_reward("", response, answer=gold)
    return score, time.perf_counter() - start


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
        results = [(timed(response, gold), want) for response, gold, want in cases(name)]
        seconds = [s for (_, s), _ in results]
        wrong = sum(score != want for (score, _), want in results)
        all_right &= wrong == 0
        report["files"][name] = {"calls": len(results), "wrong": wrong, "p50_s": percentile(seconds, 0.5),
                                 "p99_s": percentile(seconds, 0.99), "max_s": max(seconds)}
        print(name, report["files"][name], flush=True)
    adversarial = [timed(r, "5") for r in PATHOLOGICAL]
    report["pathological"] = {"answers": PATHOLOGICAL, "scores": [s for s, _ in adversarial],
                              "seconds": [t for _, t in adversarial], "max_s": max(t for _, t in adversarial)}
    report["load_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all_right and not any(report["pathological"]["scores"]) else 1


if __name__ == "__main__":
    sys.exit(main())
