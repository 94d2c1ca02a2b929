"""The cluster validation ladder: five rungs, each proving what the one below cannot.

1. ``environment``         the stack loads and sees its devices (versions, drivers): no second rank involved.
2. ``allreduce_smoke``     ranks talk and reduce *correctly* (gradient equality with a one-process reference).
3. ``collective_bandwidth`` they talk *fast*: all_reduce / all_gather / reduce_scatter from 8 B to
                           ``max_bytes``, bus bandwidth plateau and latency floor against the baseline.
4. ``tiny_training``       the real trainer (QLoRA under FSDP2, profiled) learns on this cluster:
                           loss falls, throughput against the baseline, triage verdict.
5. ``eval_gate``           the trained adapter beats its base on held-out items through the real gate.

Each rung's numbers are kept as a baseline per cluster shape (``perf.baseline``); a later run
whose plateau, latency floor, throughput or score moves beyond its threshold fails its check and
names the change (and any version or driver change since the baseline).

This module holds the plain logic (no Dagster): the rules, the cluster shape, the tiny task.
``assets/cluster.py`` turns it into the ``cluster`` asset group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perf.baseline import Rule

RUNGS = ("environment", "allreduce_smoke", "collective_bandwidth", "tiny_training", "eval_gate")


def shape(env: dict[str, Any], nodes: int, processes_per_node: int) -> str:
    """Cluster shape a baseline belongs to, e.g. ``gloo-cpu-1x2`` or ``nccl-nvidia_h100_80gb_hbm3-2x8``."""
    device = (env.get("devices") or ["cpu"])[0].lower()
    device = "".join(c if c.isalnum() else "_" for c in device).strip("_")
    return f"{env.get('backend', 'gloo')}-{device}-{nodes}x{processes_per_node}"


def bandwidth_rules(plateau_drop: float, latency_rise: float, ops: list[str]) -> dict[str, Rule]:
    rules: dict[str, Rule] = {}
    for op in ops:
        rules[f"{op}.plateau_busbw_gbps"] = Rule(higher_is_better=True, threshold=plateau_drop)
        rules[f"{op}.latency_floor_us"] = Rule(higher_is_better=False, threshold=latency_rise)
    return rules


def bandwidth_metrics(sweep: dict[str, Any]) -> dict[str, float]:
    out = {}
    for op, s in sweep["summary"].items():
        out[f"{op}.plateau_busbw_gbps"] = float(s["plateau_busbw_gbps"])
        out[f"{op}.latency_floor_us"] = float(s["latency_floor_us"])
    return out


def bandwidth_markdown(sweep: dict[str, Any]) -> str:
    from perf.collectives import _human

    ops = list(sweep["summary"])
    sizes = sorted({r["bytes"] for r in sweep["rows"]})
    by = {(r["op"], r["bytes"]): r for r in sweep["rows"]}
    lines = ["| size | " + " | ".join(f"{op} time µs | {op} busbw GB/s" for op in ops) + " |",
             "|---:|" + "---:|---:|" * len(ops)]
    for s in sizes:
        cells = []
        for op in ops:
            r = by.get((op, s))
            cells += [f"{r['time_us']:.1f}", f"{r['busbw_gbps']:.4f}"] if r else ["", ""]
        lines.append(f"| {_human(s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def training_rules(throughput_drop: float) -> dict[str, Rule]:
    return {"tokens_per_s": Rule(higher_is_better=True, threshold=throughput_drop)}


def gate_rules(score_drop: float) -> dict[str, Rule]:
    return {"candidate_score": Rule(higher_is_better=True, threshold=score_drop)}


# --------------------------------------------------------------------------- the tiny task


def tiny_task(train_items: int, eval_items: int, seed: int = 4242) -> tuple[list[dict], list[dict]]:
    """Cipher pairs with exact answers (no teacher needed): training pairs and held-out items."""
    from tinymodels import cipher

    items = cipher.items(train_items + eval_items, seed=seed, id_prefix="c")
    train = [{"id": it["id"], "prompt": it["prompt"], "completion": " " + it["reference"]}
             for it in items[:train_items]]
    return train, items[train_items:]


def tokenize_tiny(student_dir: Path, pairs: list[dict], out_dir: Path, max_seq_len: int = 64) -> Path:
    """Tokenize ``pairs`` with the project's dataset stage (packed, no validation split); returns
    the directory of training shards the trainer reads."""
    import json

    from dataprep.tokenize import BuildSettings, build_tokenized_dataset

    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "pairs.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    build_tokenized_dataset(student_dir, [src], out_dir / "built", BuildSettings(max_seq_len=max_seq_len, num_proc=1))
    return out_dir / "built" / "train"