"""Benchmark: what re-judging stored answers costs next to answering again.

The evaluation asset stores every model's answers (``evaluation_items/<key>``) apart from the
gate's judgement (``evaluation/<key>``), so a changed threshold re-runs only the statistics. This
measures, in one run on this machine:

- ``answer_s``: the demo's held-out items answered by the 4-bit demo student (one model: the base);
- ``judge_s``: the gate over those items for candidate and base (paired bootstrap, 10,000
  resamples, per-category rules, the markdown report);
- ``judge_10k_items_s``: the same gate over a synthetic 10,000-item suite (how the statistics scale);

and prints them with the ratio ``answer_s / judge_s`` (how many re-judgements one generation pass
pays for). Figures on a shared CPU are noisy; the ratio is the comparable number.

    python benchmarks/eval_gate.py [--artifacts artifacts] [--items 200]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--items", type=int, default=200)
    args = ap.parse_args()

    from campaign_orchestrator.dataset.prompts import read_prompts, source_files, split
    from campaign_orchestrator.demo.build import build_demo_models
    from campaign_orchestrator.demo.recipe import resolve
    from campaign_orchestrator.generation.local import LocalModel
    from evaluation.gate import GatePolicy, ItemResult, StatsPolicy
    from evaluation.report import build_report
    from evaluation.runner import SuiteGate, SuiteRun, answer_suites, judge
    from evaluation.scorers import build_scorer
    from evaluation.suite import load_items

    root = Path(args.artifacts).resolve()
    build_demo_models(root, log=lambda _m: None, moe=False)
    student = resolve("@demo/student", root)
    rows = read_prompts(source_files("campaigns/data/demo/*.jsonl", Path(__file__).resolve().parent.parent))
    _, held = split(rows, 0.1, 0, args.items)
    scorer = build_scorer("exact_match")
    items = load_items("heldout", held, ".", scorer)

    t0 = time.perf_counter()
    gen = LocalModel.from_path(student, None, True, "bfloat16", batch_size=64)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = answer_suites(
        [SuiteRun("cipher", items, scorer, 16)],
        {"candidate": lambda: gen.generate, "base": lambda: gen.generate},
        log=lambda _m: None,
    )
    answer_s = (time.perf_counter() - t0) / 2  # one model's pass

    def results(rows_):
        res: dict = {}
        for r in rows_:
            res.setdefault(r["model"], {}).setdefault(r["suite"], []).append(
                ItemResult(
                    r["item_id"],
                    r["category"],
                    r["output"],
                    r["score"],
                    r["latency_s"],
                    r["error"],
                    r["prompt"],
                    r["reference"],
                )
            )
        return res

    policy = GatePolicy(min_score=0.8, max_category_regression=0.05, min_items=50)
    sp = StatsPolicy()

    def judge_once(res) -> float:
        t = time.perf_counter()
        reports = judge(res, [SuiteGate("cipher", policy, True)], sp)
        build_report(reports, {"cipher": (res["candidate"]["cipher"], res["base"]["cipher"])}, sp, "bench")
        return time.perf_counter() - t

    res = results(out)
    judge_s = min(judge_once(res) for _ in range(3))

    rnd = random.Random(0)
    big = []
    for role, p in (("candidate", 0.8), ("base", 0.78)):
        big += [
            {
                "model": role,
                "suite": "cipher",
                "item_id": str(i),
                "category": f"c{i % 8}",
                "output": "x",
                "score": float(rnd.random() < p),
                "latency_s": 0.1,
                "error": None,
                "prompt": "",
                "reference": "",
            }
            for i in range(10_000)
        ]
    judge_10k_s = min(judge_once(results(big)) for _ in range(2))

    print(
        json.dumps(
            {
                "benchmark": "eval_gate",
                "items": len(items),
                "model_load_s": round(load_s, 3),
                "answer_s": round(answer_s, 3),
                "judge_s": round(judge_s, 4),
                "judge_10k_items_s": round(judge_10k_s, 4),
                "answer_over_judge": round(answer_s / judge_s, 1),
                "note": "same-run ratio; absolute seconds vary with machine load",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
