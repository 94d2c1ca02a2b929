"""The cluster validation ladder: five rungs, each proving what the one below cannot.

1. ``environment``         the stack loads and sees its devices (versions, drivers): no second rank involved.
2. ``allreduce_smoke``     ranks talk and reduce *correctly* (gradient equality with a one-process reference).
3. ``collective_bandwidth`` they talk *fast*: all_reduce / all_gather / reduce_scatter from 8 B to
                           ``max_bytes``, bus bandwidth plateau and latency floor against the baseline.
4. ``tiny_training``       the real trainer (QLoRA under FSDP2, profiled) learns on this cluster:
                           loss falls, throughput against the baseline, triage verdict.
5. ``eval_gate``           the trained adapter beats its base on held-out items through the real gate.

Each rung's numbers are kept as a baseline per cluster shape (``training.cluster.baseline``); a later run
whose gradient error, plateau, latency floor, throughput or score moves beyond its threshold fails
its check and names the change (and any version or driver change since the baseline); one that
moves as far the other way passes with a warning to rebaseline if intended. A run that fails its
own correctness check is never recorded as a baseline.

This module holds the plain logic (no Dagster): the rules, the cluster shape, the tiny task.
``assets/cluster.py`` turns it into the ``cluster`` asset group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from training.cluster.baseline import BaselineStore, Rule, Verdict

RUNGS = ("environment", "allreduce_smoke", "collective_bandwidth", "tiny_training", "eval_gate")


def shape(env: dict[str, Any], nodes: int, processes_per_node: int) -> str:
    """Cluster shape a baseline belongs to, e.g. ``gloo-cpu-1x2`` or ``nccl-nvidia_h100_80gb_hbm3-2x8``."""
    device = (env.get("devices") or ["cpu"])[0].lower()
    device = "".join(c if c.isalnum() else "_" for c in device).strip("_")
    return f"{env.get('backend', 'gloo')}-{device}-{nodes}x{processes_per_node}"


# Same stack, same seed, same reduction order: the all-reduce's distance from the one-process
# gradient is deterministic (2.4e-7 for gloo on two CPU ranks here), so doubling it, or halving it,
# means the reduction changed (algorithm, precision, rank count), even while it stays correct.
ALLREDUCE_DIFF_CHANGE = 0.5


def allreduce_metrics(result: dict[str, Any], wall_seconds: float | None = None) -> dict[str, float]:
    """The all-reduce smoke's numbers for its baseline (an AVG that failed has no difference to keep)."""
    out = {"world_size": float(result["world_size"]), "sum_max_abs_diff": float(result["sum_max_abs_diff"])}
    if result.get("avg_max_abs_diff") is not None:
        out["avg_max_abs_diff"] = float(result["avg_max_abs_diff"])
    if wall_seconds is not None:
        out["wall_seconds"] = float(wall_seconds)
    return out


def allreduce_rules(diff_change: float = ALLREDUCE_DIFF_CHANGE) -> dict[str, Rule]:
    """Rules on the gradient differences only: the world size is fixed by the shape, and the wall
    time (kept for reference) is process start-up and imports, not the collective."""
    return {
        "sum_max_abs_diff": Rule(higher_is_better=False, threshold=diff_change),
        "avg_max_abs_diff": Rule(higher_is_better=False, threshold=diff_change),
    }


def check_allreduce(
    store: BaselineStore,
    shape: str,
    result: dict[str, Any],
    fingerprint: dict[str, str],
    correct: bool,
    rebaseline: bool = False,
    wall_seconds: float | None = None,
) -> Verdict:
    """The all-reduce rung against its baseline; recorded only when the gradients were ``correct``."""
    return store.check(
        "allreduce_smoke",
        shape,
        allreduce_metrics(result, wall_seconds),
        fingerprint,
        allreduce_rules(),
        rebaseline,
        record=correct,
    )


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


def sweep_wrong(sweep: dict[str, Any]) -> dict[str, int]:
    """Per op, how many message sizes returned a wrong result (nccl-tests' ``#wrong``)."""
    return {op: int(s["wrong"]) for op, s in sweep["summary"].items()}


def check_bandwidth(
    store: BaselineStore,
    shape: str,
    sweep: dict[str, Any],
    fingerprint: dict[str, str],
    plateau_drop: float,
    latency_rise: float,
    rebaseline: bool = False,
) -> Verdict:
    """The bandwidth rung against its baseline; a sweep with any wrong result is never recorded
    (not as the first baseline, not on ``rebaseline``): its numbers timed a broken collective."""
    return store.check(
        "collective_bandwidth",
        shape,
        bandwidth_metrics(sweep),
        fingerprint,
        bandwidth_rules(plateau_drop, latency_rise, list(sweep["summary"])),
        rebaseline,
        record=not any(sweep_wrong(sweep).values()),
    )


def bandwidth_markdown(sweep: dict[str, Any]) -> str:
    from training.cluster.collectives import _human

    ops = list(sweep["summary"])
    sizes = sorted({r["bytes"] for r in sweep["rows"]})
    by = {(r["op"], r["bytes"]): r for r in sweep["rows"]}
    lines = [
        "| size | " + " | ".join(f"{op} time µs | {op} busbw GB/s" for op in ops) + " |",
        "|---:|" + "---:|---:|" * len(ops),
    ]
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
    from campaign_orchestrator.demo import cipher

    items = cipher.items(train_items + eval_items, seed=seed, id_prefix="c")
    train = [
        {"id": it["id"], "prompt": it["prompt"], "completion": " " + it["reference"]} for it in items[:train_items]
    ]
    return train, items[train_items:]


def tokenize_tiny(student_dir: Path, pairs: list[dict], out_dir: Path, max_seq_len: int = 64) -> Path:
    """Tokenize ``pairs`` with the project's dataset stage (packed, no validation split); returns
    the directory of training shards the trainer reads."""
    import json

    from campaign_orchestrator.dataset.tokenize import BuildSettings, build_tokenized_dataset

    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "pairs.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    build_tokenized_dataset(student_dir, [src], out_dir / "built", BuildSettings(max_seq_len=max_seq_len, num_proc=1))
    return out_dir / "built" / "train"
