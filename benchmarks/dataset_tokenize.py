"""Benchmark: build the tokenized dataset (the tokenized_dataset stage's code: batched fast tokenization
with datasets ``map``, best-fit-decreasing packing, sharded Parquet) against an honest baseline, on
the same demo-like prompt/completion pairs, in one run.

    python benchmarks/dataset_tokenize.py [--pairs 200000] [--max-seq-len 64] [--num-proc N] [--per-row]

Baseline (what a careful user writes without this project): ``datasets.load_dataset("json")`` and
``Dataset.map(batched=True, num_proc=N)`` calling the tokenizer's own batched ``__call__`` on the
prompts and on the completions, each example padded to ``max_seq_len``, one Parquet file. ``N`` is
the number of processes the stage itself uses for these inputs (``dataset.tokenize.default_num_proc``,
or ``--num-proc``), so both sides have the same cores. ``--per-row`` adds the old per-text loop
(one ``tokenizer(...)`` call per text in one process) as a further, flattering, figure.

Packing efficiency (real tokens / row capacity) is read from the shards the stage wrote (their
``num_tokens`` over rows × ``max_seq_len``), at the benchmark's max length and, with a second build
of the same pairs, at ``--efficiency-max-seq-len`` (512, the spec default), where the ≥ 0.97 target
is checked: the demo's sequences are 18-29 tokens, so rows of 64 tokens cannot be filled past ~0.96
by any packing. Where the time goes is printed from the stage's own phase timings (read, tokenize,
split, pack, write) beside the baseline's reading and tokenizing alone (its map without padding or writing).

Targets: speed-up ≥ 3 against the batched baseline with the same processes (wall clock), packing
efficiency ≥ 0.97. ``cpu_time_ratio`` (CPU seconds, map workers included) is printed as well: on a
shared machine it is the steadier figure of the work saved.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

from _dataset_common import demo_pairs, demo_student, emit, load_average, write_jsonl


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the map workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def naive(model_dir: Path, src: Path, out: Path, max_seq_len: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    t0, c0 = time.perf_counter(), cpu_seconds()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cols: dict[str, list] = {"input_ids": [], "labels": [], "attention_mask": []}
    real = dropped = 0
    with src.open() as f:
        for line in f:
            ex = json.loads(line)
            p = tok(ex["prompt"])["input_ids"]
            c = tok(ex["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = p + c
            if len(ids) > max_seq_len:
                dropped += 1
                continue
            pad = max_seq_len - len(ids)
            cols["input_ids"].append(ids + [tok.pad_token_id] * pad)
            cols["labels"].append([-100] * len(p) + c + [-100] * pad)
            cols["attention_mask"].append([1] * len(ids) + [0] * pad)
            real += len(ids)
    t = pa.table({k: pa.array(v, pa.list_(pa.int32())) for k, v in cols.items()})
    pq.write_table(t, out)
    rows = t.num_rows
    return {
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": cpu_seconds() - c0,
        "rows": rows,
        "real_tokens": real,
        "dropped": dropped,
        "efficiency": real / (rows * max_seq_len),
    }


def packed(model_dir: Path, src: Path, out: Path, max_seq_len: int, num_proc: int | None) -> dict:
    from campaign_orchestrator.dataset.tokenize import BuildSettings, build_tokenized_dataset

    t0, c0 = time.perf_counter(), cpu_seconds()
    rep = build_tokenized_dataset(model_dir, [src], out, BuildSettings(max_seq_len=max_seq_len, num_proc=num_proc))
    return {
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": cpu_seconds() - c0,
        "rows": rep["rows"],
        "real_tokens": rep["total_tokens"],
        "examples_out": rep["examples_out"],
        "dropped": rep["dropped_total"],
        "efficiency": rep["packing_efficiency"],
        "shards": rep["shards"],
        "bytes": rep["bytes"],
        "phases": rep["timings"],
    }


def batched(
    model_dir: Path, src: Path, out: Path, max_seq_len: int, num_proc: int, work: Path, write: bool = True
) -> dict:
    """The baseline: ``Dataset.map(batched=True, num_proc)`` over the tokenizer's batched call, padded rows.

    ``write=False`` stops after tokenizing (no padding, no Parquet): the tokenizer alone, for the time split."""
    import datasets
    from transformers import AutoTokenizer

    t0, c0 = time.perf_counter(), cpu_seconds()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ds = datasets.load_dataset("json", data_files=str(src), split="train", cache_dir=str(work / "hf-cache"))
    pad, eos = tok.pad_token_id, tok.eos_token_id

    def encode(batch):
        ps = tok(batch["prompt"])["input_ids"]
        cs = tok(batch["completion"], add_special_tokens=False)["input_ids"]
        if not write:
            return {"n": [len(p) + len(c) + 1 for p, c in zip(ps, cs, strict=False)]}
        ids, labels, mask = [], [], []
        for p, c in zip(ps, cs, strict=False):
            c = c + [eos]
            n = len(p) + len(c)
            if n > max_seq_len:
                continue
            k = max_seq_len - n
            ids.append(p + c + [pad] * k)
            labels.append([-100] * len(p) + c + [-100] * k)
            mask.append([1] * n + [0] * k)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    enc = ds.map(
        encode,
        batched=True,
        batch_size=1000,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=ds.column_names,
        desc="baseline tokenize",
    )
    if write:
        enc.to_parquet(str(out))
    res: dict = {"seconds": time.perf_counter() - t0, "cpu_seconds": cpu_seconds() - c0, "num_proc": num_proc}
    if write:  # the figures below are not part of the timed work
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        mask = pq.read_table(out, columns=["attention_mask"]).column(0)
        real = int(pc.sum(pc.list_flatten(mask)).as_py())
        res |= {
            "rows": enc.num_rows,
            "real_tokens": real,
            "dropped": ds.num_rows - enc.num_rows,
            "efficiency": real / (enc.num_rows * max_seq_len),
        }
    return res


def tokenizer_call_only(model_dir: Path, src: Path) -> float:
    """Seconds of the fast tokenizer's own batched calls on every prompt and completion, one process, texts
    already in memory: the floor under any build (divided by the processes, at best)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [json.loads(line) for line in src.open()]
    prompts, completions = [r["prompt"] for r in rows], [r["completion"] for r in rows]
    t0 = time.perf_counter()
    for i in range(0, len(rows), 1000):
        tok(prompts[i : i + 1000])
        tok(completions[i : i + 1000], add_special_tokens=False)
    return time.perf_counter() - t0


def written_efficiency(out: Path) -> dict:
    """Packing efficiency of the dataset the stage wrote: real tokens of its shards / (rows × max_seq_len)."""
    import pyarrow.parquet as pq

    rows = tokens = 0
    msl = None
    for f in sorted(out.rglob("*.parquet")):
        t = pq.read_table(f, columns=["num_tokens"])
        rows, tokens = rows + t.num_rows, tokens + sum(t.column(0).to_pylist())
        msl = int((pq.read_schema(f).metadata or {})[b"campaign.max_seq_len"])
    return {"rows": rows, "tokens": tokens, "max_seq_len": msl, "efficiency": round(tokens / (rows * msl), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--max-seq-len", type=int, default=64, help="the demo's training.max_seq_len")
    ap.add_argument(
        "--efficiency-max-seq-len", type=int, default=512, help="where the >= 0.97 packing target is checked"
    )
    ap.add_argument("--num-proc", type=int, default=None, help="default: what the stage picks for these inputs")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--per-row", action="store_true", help="also time the per-text loop in one process")
    args = ap.parse_args()

    from campaign_orchestrator.dataset.tokenize import default_num_proc

    nproc = default_num_proc(args.pairs, args.num_proc)
    model = demo_student()
    work = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    try:
        src = write_jsonl(demo_pairs(args.pairs), work / "pairs.jsonl")
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(model))  # warm-up: library imports are paid by neither side
        load_before = load_average()
        bases, oursl, toks = [], [], []
        for i in range(args.repeats):  # alternating; the best of each (other tenants only ever slow a run down)
            bases.append(batched(model, src, work / f"batched-{i}.parquet", args.max_seq_len, nproc, work / f"b{i}"))
            shutil.rmtree(work / "packed", ignore_errors=True)
            oursl.append(packed(model, src, work / "packed", args.max_seq_len, nproc))
            toks.append(batched(model, src, work / "unused", args.max_seq_len, nproc, work / f"t{i}", write=False))
        base, ours, tok_only = (min(x, key=lambda r: r["seconds"]) for x in (bases, oursl, toks))
        floor = min(tokenizer_call_only(model, src) for _ in range(args.repeats))
        per_row = naive(model, src, work / "naive.parquet", args.max_seq_len) if args.per_row else None
        eff = written_efficiency(work / "packed")
        packed(model, src, work / f"packed-{args.efficiency_max_seq_len}", args.efficiency_max_seq_len, nproc)
        eff_target = written_efficiency(work / f"packed-{args.efficiency_max_seq_len}")
    finally:
        load_after = load_average()
        shutil.rmtree(work, ignore_errors=True)
    speedup = base["seconds"] / ours["seconds"]
    phases = ours["phases"]
    r4 = lambda d: {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}  # noqa: E731
    result = {
        "benchmark": "dataset_tokenize",
        "pairs": args.pairs,
        "max_seq_len": args.max_seq_len,
        "num_proc": nproc,
        "baseline_batched_map_padded": r4(base),
        "stage_tokenize_pack_shard": r4(ours),
        "speedup_vs_batched_baseline": round(speedup, 2),
        "cpu_time_ratio_vs_batched_baseline": round(base["cpu_seconds"] / ours["cpu_seconds"], 2),
        "examples_per_s": {
            "batched_baseline": round(args.pairs / base["seconds"]),
            "stage": round(args.pairs / ours["seconds"]),
        },
        "where_the_time_goes": {
            "stage_phases_s": phases,
            "stage_tokenize_share": round(phases.get("tokenize_s", 0.0) / ours["seconds"], 3),
            "baseline_read_and_tokenize_only_s": round(tok_only["seconds"], 3),
            "baseline_read_and_tokenize_share": round(tok_only["seconds"] / base["seconds"], 3),
            "tokenizer_calls_alone_one_process_s": round(floor, 3),
            "tokenizer_floor_with_num_proc_s": round(floor / nproc, 3),
            "stage_over_tokenizer_floor": round(ours["seconds"] / (floor / nproc), 2),
            "baseline_over_tokenizer_floor_max_possible_speedup": round(base["seconds"] / (floor / nproc), 2),
        },
        "packing_efficiency_written": {
            str(args.max_seq_len): eff,
            str(args.efficiency_max_seq_len): eff_target,
            "padded_baseline": round(base["efficiency"], 4),
        },
        "targets": {
            "speedup_vs_batched_baseline": {"target": ">= 3.0", "value": round(speedup, 2), "met": speedup >= 3.0},
            "packing_efficiency": {
                "target": ">= 0.97",
                "checked_at_max_seq_len": args.efficiency_max_seq_len,
                "value": eff_target["efficiency"],
                "met": eff_target["efficiency"] >= 0.97,
            },
        },
        "seconds_all_runs": {
            "batched_baseline": [round(r["seconds"], 3) for r in bases],
            "stage": [round(r["seconds"], 3) for r in oursl],
            "baseline_read_and_tokenize_only": [round(r["seconds"], 3) for r in toks],
        },
        "load_average_before": load_before,
        "load_average_after": load_after,
    }
    if per_row is not None:
        result["per_row_loop_one_process"] = r4(per_row)
        result["speedup_vs_per_row_loop"] = round(per_row["seconds"] / ours["seconds"], 2)
    result["pass"] = (
        result["targets"]["speedup_vs_batched_baseline"]["met"] and result["targets"]["packing_efficiency"]["met"]
    )
    return emit(result)


if __name__ == "__main__":
    raise SystemExit(main())
