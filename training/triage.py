"""Read torch.profiler Chrome traces and say why training is slow.

Per rank, every profiled step (``ProfilerStep#N``) is cut into exclusive parts that add up to
the step time:

``compute``    the device (or, on a CPU-only trace, the host thread that runs the step) doing work.
``comm``       collective communication: NCCL kernels on a GPU; on a CPU trace, ``c10d::*`` ops,
               FSDP all-gather / reduce-scatter regions, and gloo collectives running on gloo's own
               threads while the step thread waits for them.
``data``       the input pipeline: from the start of the step to the first forward op (a
               ``DataLoader`` ``__next__``, collation, waiting for a batch), and any DataLoader
               region elsewhere in the step. On a GPU trace with step markers on the device
               timeline: the device's idle time at the start of its step.
``h2d``        host-to-device copies (``Memcpy HtoD`` on the device; none on a CPU-only trace).
``idle``       nothing recorded: Python overhead, kernel launch gaps, waits that no op covers.

On a GPU trace the device timeline decides (compute hides overlapped communication, so only
*exposed* communication counts); on a CPU trace the step thread decides (an FSDP all-gather region
is communication even though it copies memory).

The verdict follows one fixed decision tree, first match wins (thresholds in :class:`Thresholds`):

1. ``straggler``           ranks differ in non-communication time by >= 15% of the step: the others
                           wait for the slowest at every collective (checked first, because a
                           straggler makes everybody else look communication-bound).
2. ``data-starved``        the input pipeline takes >= 20% of the step (idle before forward).
3. ``communication-bound`` exposed collectives take >= 30% of the step.
4. ``host-copy-bound``     host-to-device copies take >= 10% of the step.
5. ``launch-bound``        >= 30% of the step is idle gaps between ops whose median is <= 20 µs.
6. ``compute-bound``       none of the above: the device is busy computing.

Module contents are pure Python (json, re, statistics): usable from the trainer, from Dagster
assets and from the command line (``python -m training.triage TRACE_OR_DIR ...``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

VERDICTS = ("straggler", "data-starved", "communication-bound", "host-copy-bound", "launch-bound", "compute-bound")
PARTS = ("compute", "comm", "data", "h2d", "idle")

FIXES: dict[str, list[str]] = {
    "straggler": [
        "find the slow rank's node in the diagnostics: clock throttling (nvidia-smi -q -d PERFORMANCE: "
        "HW Slowdown, Thermal, Power Cap), a busier host, a degraded link",
        "check load imbalance: sequence lengths per rank (bucket or pack sequences so every rank gets equal tokens)",
        "check that no rank does extra work (logging, evaluation, checkpoint writes) inside the step",
    ],
    "data-starved": [
        "more DataLoader workers (num_workers), persistent_workers=True",
        "pin_memory=True and .to(device, non_blocking=True)",
        "prefetch: prefetch_factor, or pre-tokenize/pack offline so the step only slices tensors",
    ],
    "communication-bound": [
        "sharding: hybrid (shard inside a node, replicate across nodes) instead of full sharding across nodes",
        "more gradient accumulation steps (fewer collectives per token), larger micro-batches",
        "check NCCL_IB_HCA / NCCL_SOCKET_IFNAME name the fast fabric (NCCL_DEBUG=INFO shows the transport used), "
        "and compare the collective bandwidth sweep with its baseline",
    ],
    "host-copy-bound": [
        "pin host memory (pin_memory=True) and copy with non_blocking=True",
        "move preprocessing (masking, padding, casting) onto the device; copy each batch once per step",
        "avoid .item()/.cpu() inside the step (each one is a device-to-host sync)",
    ],
    "launch-bound": [
        "torch.compile the model (fuses small ops, fewer launches)",
        "CUDA graphs (torch.compile mode='reduce-overhead') for static shapes",
        "larger micro-batches so each kernel does more work",
    ],
    "compute-bound": [
        "the device is busy: go faster with larger batches, fused kernels (flash attention, fused optimizers), "
        "bf16, or more devices",
    ],
}

TOPOLOGY = (
    "Topology: fit the job on a single NVLink node first (every all-gather and reduce-scatter then runs at "
    "NVLink speed); across nodes prefer hybrid sharding (shard inside a node, replicate across nodes) over "
    "full sharding unless memory forces it."
)

# Host-side names of collective communication (CPU traces; GPU traces use the device kernels).
COMM = re.compile(
    r"^(c10d::|c10d_functional::|_c10d_functional::|gloo:|nccl:|record_param_comms"
    r"|FSDP::all_gather(\s|$)|FSDP::post_backward_reduce|FSDP::post_backward_rs_wait|FSDP::.*wait"
    r"|DDP::.*(allreduce|reduce))"
)
# Collectives executing on a backend's own thread (gloo's pt_gloo_runloop).
BACKEND_COLLECTIVE = re.compile(r"^(gloo:|nccl:)")
DATA = re.compile(r"(enumerate\(DataLoader\)|DataLoader.*__next__|^data(_loading|_wait|loader)?$|^## data)", re.I)
FORWARD = re.compile(
    r"^(FSDP::root_pre_forward|FSDP::pre_forward|DistributedDataParallel\.forward|nn\.Module: "
    r"|## forward|aten::embedding$)"
)
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cpu_op", "user_annotation"})
NCCL_KERNEL = re.compile(r"^nccl", re.I)
H2D = re.compile(r"Memcpy HtoD")


@dataclass(frozen=True)
class Thresholds:
    """Fractions of the step time (and one duration) at which the decision tree fires."""

    straggler_spread: float = 0.15
    data_fraction: float = 0.20
    comm_fraction: float = 0.30
    h2d_fraction: float = 0.10
    launch_idle_fraction: float = 0.30
    tiny_op_us: float = 20.0


# --------------------------------------------------------------------------- intervals

Interval = tuple[float, float]


def _union(iv: list[Interval]) -> list[Interval]:
    out: list[list[float]] = []
    for a, b in sorted(x for x in iv if x[1] > x[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """``a - b`` for two unions (sorted, disjoint)."""
    out: list[Interval] = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def _total(iv: list[Interval]) -> float:
    return sum(b - a for a, b in iv)


def _clip(e: dict, s0: float, s1: float) -> Interval:
    return max(s0, float(e["ts"])), min(s1, float(e["ts"]) + float(e.get("dur", 0.0)))


# --------------------------------------------------------------------------- one rank


def load_trace(path: str | Path) -> dict:
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not a Chrome trace JSON file ({e})") from None
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{p}: expected a Chrome trace (an object with a 'traceEvents' list)")
    return data


def trace_rank(trace: dict, path: str | Path | None = None) -> int | None:
    info = trace.get("distributedInfo") or {}
    if "rank" in info:
        return int(info["rank"])
    m = re.search(r"rank[-_]?(\d+)", Path(path).name) if path else None
    return int(m.group(1)) if m else None


@dataclass
class RankBreakdown:
    """Where one rank's profiled steps went (sums over steps, in milliseconds)."""

    rank: int
    mode: str  # "device" (GPU timeline) or "host" (CPU-only trace: the step thread)
    steps: int = 0
    step_ms: float = 0.0
    compute_ms: float = 0.0
    comm_ms: float = 0.0
    data_ms: float = 0.0
    h2d_ms: float = 0.0
    idle_ms: float = 0.0
    ops: int = 0
    median_op_us: list[float] = field(default_factory=list)  # one median per step
    notes: list[str] = field(default_factory=list)

    def per_step(self) -> dict[str, Any]:
        n = max(1, self.steps)
        out: dict[str, Any] = {"rank": self.rank, "mode": self.mode, "steps": self.steps, "step_ms": self.step_ms / n}
        for p in PARTS:
            out[f"{p}_ms"] = getattr(self, f"{p}_ms") / n
            out[f"{p}_fraction"] = getattr(self, f"{p}_ms") / self.step_ms if self.step_ms else 0.0
        out["ops_per_step"] = self.ops / n
        out["median_op_us"] = statistics.median(self.median_op_us) if self.median_op_us else 0.0
        out["notes"] = list(self.notes)
        return out

    def merge(self, other: RankBreakdown) -> RankBreakdown:
        for f in ("steps", "step_ms", "compute_ms", "comm_ms", "data_ms", "h2d_ms", "idle_ms", "ops"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.median_op_us += other.median_op_us
        self.notes += [n for n in other.notes if n not in self.notes]
        return self


def _top_level(events: list[dict]) -> list[dict]:
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e.get("dur", 0.0)
    return out


def analyze_trace(trace: dict, rank: int | None = None) -> RankBreakdown:
    """Split every ``ProfilerStep#N`` of one rank's trace into compute / comm / data / h2d / idle."""
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e and isinstance(e.get("ts"), int | float)]
    rank = trace_rank(trace) if rank is None else rank
    device = [e for e in xs if e.get("cat") in DEVICE_CATS]
    host = [e for e in xs if e.get("cat") in HOST_CATS]
    out = RankBreakdown(rank=rank if rank is not None else 0, mode="device" if device else "host")
    steps = [e for e in host if e["name"].startswith("ProfilerStep#")]
    if not host and not device:
        out.notes.append("the trace holds no op events")
        return out
    if steps:
        main = (steps[0].get("pid"), steps[0].get("tid"))
    else:
        busiest: dict[tuple, float] = {}
        for e in host:
            busiest[(e.get("pid"), e.get("tid"))] = busiest.get((e.get("pid"), e.get("tid")), 0.0) + e.get("dur", 0.0)
        main = max(busiest, key=busiest.get) if busiest else (None, None)
        everything = host + device
        t0 = min(e["ts"] for e in everything)
        t1 = max(e["ts"] + e.get("dur", 0.0) for e in everything)
        steps = [{"name": "ProfilerStep#all", "ts": t0, "dur": t1 - t0}]
        out.notes.append(
            "no ProfilerStep markers (not recorded with a torch.profiler schedule): the whole trace is one step"
        )
    main_ops = [e for e in host if (e.get("pid"), e.get("tid")) == main and not e["name"].startswith("ProfilerStep#")]
    backend = [e for e in host if (e.get("pid"), e.get("tid")) != main and BACKEND_COLLECTIVE.match(e["name"])]
    # The device runs behind the host: when the trace has the step markers on the device timeline
    # (Kineto's gpu_user_annotation), device windows decide, and the input wait is the device's
    # idle time at the start of its step.
    device_steps = [e for e in xs if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("ProfilerStep#")]
    on_device = bool(device and device_steps)
    for s in sorted(device_steps if on_device else steps, key=lambda e: e["ts"]):
        s0, s1 = float(s["ts"]), float(s["ts"]) + float(s["dur"])
        if s1 <= s0:
            continue
        inside = [e for e in main_ops if s0 <= e["ts"] < s1]
        if on_device:
            first = min((e["ts"] for e in device if s0 <= e["ts"] < s1), default=s1)
            data = [(s0, first)] if first > s0 else []
        else:
            fwd = [e["ts"] for e in inside if FORWARD.match(e["name"])]
            data = _union(
                ([(s0, min(fwd))] if fwd else []) + [_clip(e, s0, s1) for e in inside if DATA.search(e["name"])]
            )
        if out.mode == "host":
            busy = _union([_clip(e, s0, s1) for e in inside])
            waits = _subtract(
                _union([_clip(e, s0, s1) for e in backend if e["ts"] < s1 and e["ts"] + e["dur"] > s0]), busy
            )
            comm = _union([_clip(e, s0, s1) for e in inside if COMM.match(e["name"])] + waits)
            parts = {"comm": comm, "h2d": [], "data": data, "compute": busy}
            order = ("comm", "h2d", "data", "compute")
            tops = [e for e in _top_level(inside) if e.get("cat") == "cpu_op"]
        else:
            dev = [e for e in device if e["ts"] < s1 and e["ts"] + e.get("dur", 0.0) > s0]
            is_comm = [bool(NCCL_KERNEL.match(e["name"])) for e in dev]
            is_h2d = [bool(H2D.search(e["name"])) for e in dev]
            comm = _union([_clip(e, s0, s1) for e, c in zip(dev, is_comm, strict=True) if c])
            h2d = _union([_clip(e, s0, s1) for e, h in zip(dev, is_h2d, strict=True) if h])
            compute = _union([_clip(e, s0, s1) for e, c, h in zip(dev, is_comm, is_h2d, strict=True) if not (c or h)])
            parts = {"compute": compute, "comm": comm, "h2d": h2d, "data": data}
            order = ("compute", "comm", "h2d", "data")
            tops = [e for e in dev if e.get("cat") == "kernel"]
        taken: list[Interval] = []
        for name in order:
            mine = _subtract(parts[name], taken)
            setattr(out, f"{name}_ms", getattr(out, f"{name}_ms") + _total(mine) / 1e3)
            taken = _union(taken + mine)
        out.idle_ms += (s1 - s0 - _total(taken)) / 1e3
        out.step_ms += (s1 - s0) / 1e3
        out.steps += 1
        out.ops += len(tops)
        if tops:
            out.median_op_us.append(statistics.median(e.get("dur", 0.0) for e in tops))
    return out


def analyze_files(paths: list[str | Path]) -> list[RankBreakdown]:
    """One breakdown per rank (cycles of the same rank are merged), ordered by rank."""
    by_rank: dict[int, RankBreakdown] = {}
    for i, p in enumerate(sorted(Path(x) for x in paths)):
        t = load_trace(p)
        r = trace_rank(t, p)
        b = analyze_trace(t, r if r is not None else i)
        by_rank[b.rank] = by_rank[b.rank].merge(b) if b.rank in by_rank else b
    return [by_rank[r] for r in sorted(by_rank)]


def trace_files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    files = sorted(set(p.rglob("*.pt.trace.json")) | set(p.rglob("*.pt.trace.json.gz")))
    return files or sorted(p.rglob("*.json"))


# --------------------------------------------------------------------------- all ranks


def topology_advice(context: dict | None = None) -> str:
    """The fixed topology advice, with a line about this run's layout when it is known."""
    c = context or {}
    nodes, procs, sharding = c.get("nodes"), c.get("processes_per_node"), c.get("sharding")
    if nodes is None:
        return TOPOLOGY
    if nodes > 1 and sharding == "full":
        mine = (
            f" This run shards fully across {nodes} nodes: every all-gather and reduce-scatter crosses the "
            f"inter-node fabric; try `sharding: hybrid` unless one node's memory cannot hold a replica of the "
            f"sharded model state."
        )
    elif nodes > 1:
        mine = f" This run spans {nodes} nodes with `sharding: {sharding}`: only gradient reductions cross nodes."
    else:
        mine = f" This run fits one node ({procs} process(es))."
    return TOPOLOGY + mine


def fixes_for(verdict: str, context: dict | None = None) -> list[str]:
    """The fixes of a verdict, the first one adapted to this run's layout when it is known."""
    fixes = list(FIXES[verdict])
    c = context or {}
    if verdict == "communication-bound" and c.get("nodes") == 1:
        fixes[0] = (
            "one node: the collectives should ride NVLink: check the topology diagnostics (nvidia-smi topo -m, "
            "nvlink -s); with a frozen (4-bit) base and small adapters, `sharding: none` (replicate the base, "
            "all-reduce only adapter gradients) removes the per-layer all-gathers if memory allows"
        )
    return fixes


def decide(ranks: list[dict], context: dict | None = None, t: Thresholds = Thresholds()) -> dict[str, Any]:
    """The verdict for a run from its per-rank per-step breakdowns (:meth:`RankBreakdown.per_step`)."""
    ranks = [r for r in ranks if r["steps"] > 0]
    if not ranks:
        return {
            "verdict": None,
            "reason": "no profiled step in any trace (training shorter than the profiler "
            "schedule's skip_first + wait + warmup + 1?)",
            "ranks": [],
            "fixes": [],
            "decision_path": [],
            "topology_advice": topology_advice(context),
        }
    n = len(ranks)
    mean = {p: statistics.fmean(r[f"{p}_fraction"] for r in ranks) for p in PARTS}
    step_ms = statistics.fmean(r["step_ms"] for r in ranks)
    non_comm = [r["step_ms"] - r["comm_ms"] for r in ranks]
    spread = (max(non_comm) - min(non_comm)) / step_ms if n > 1 and step_ms > 0 else 0.0
    slowest = ranks[non_comm.index(max(non_comm))]["rank"]
    median_op = statistics.median(r["median_op_us"] for r in ranks)
    path: list[str] = []

    def rule(name: str, value: float, limit: float, what: str, fmt: str = "{:.0%}") -> bool:
        hit = value >= limit
        path.append(
            f"{name}? {what} {fmt.format(value)} {'>=' if hit else '<'} {fmt.format(limit)}: {'yes' if hit else 'no'}"
        )
        return hit

    if n > 1 and rule("straggler", spread, t.straggler_spread, "spread of non-communication time between ranks"):
        verdict = "straggler"
        reason = (
            f"rank {slowest} spends {max(non_comm):.1f} ms per step outside collectives, the fastest rank "
            f"{min(non_comm):.1f} ms (spread {spread:.0%} of the {step_ms:.1f} ms step): the other ranks "
            f"wait for rank {slowest} at every collective"
        )
    elif rule("data-starved", mean["data"], t.data_fraction, "input pipeline (before forward)"):
        verdict, reason = (
            "data-starved",
            f"the input pipeline takes {mean['data']:.0%} of the step before forward starts",
        )
    elif rule("communication-bound", mean["comm"], t.comm_fraction, "exposed collectives"):
        verdict, reason = "communication-bound", f"collectives take {mean['comm']:.0%} of the step"
    elif rule("host-copy-bound", mean["h2d"], t.h2d_fraction, "host-to-device copies"):
        verdict, reason = "host-copy-bound", f"host-to-device copies take {mean['h2d']:.0%} of the step"
    elif (
        rule("launch-bound", mean["idle"], t.launch_idle_fraction, "idle gaps between ops")
        and median_op <= t.tiny_op_us
    ):
        path[-1] += f" and median op {median_op:.1f} µs <= {t.tiny_op_us:g} µs: yes"
        verdict = "launch-bound"
        reason = (
            f"{mean['idle']:.0%} of the step is gaps between ops whose median lasts {median_op:.1f} µs "
            f"({statistics.fmean(r['ops_per_step'] for r in ranks):.0f} ops per step)"
        )
    else:
        if path[-1].endswith("yes"):
            path[-1] += f" but median op {median_op:.1f} µs > {t.tiny_op_us:g} µs: no"
        verdict = "compute-bound"
        reason = f"compute takes {mean['compute']:.0%} of the step; no other part crosses its threshold"
    return {
        "verdict": verdict,
        "reason": reason,
        "fixes": fixes_for(verdict, context),
        "decision_path": path,
        "topology_advice": topology_advice(context),
        "step_ms": step_ms,
        "fractions": mean,
        "straggler_spread": spread,
        "slowest_rank": slowest,
        "median_op_us": median_op,
        "world_size": n,
        "thresholds": asdict(t),
        "ranks": ranks,
    }


def triage_files(paths: list[str | Path], context: dict | None = None, t: Thresholds = Thresholds()) -> dict:
    return decide([b.per_step() for b in analyze_files(paths)], context, t)


# --------------------------------------------------------------------------- rendering


def markdown_table(result: dict) -> str:
    lines = [
        "| rank | steps | step ms | compute | comm | data | h2d copy | idle | ops/step | median op µs |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.get("ranks", []):
        cells = " | ".join(f"{r[f'{p}_ms']:.1f} ms ({r[f'{p}_fraction']:.0%})" for p in PARTS)
        lines.append(
            f"| {r['rank']} | {r['steps']} | {r['step_ms']:.1f} | {cells} | {r['ops_per_step']:.0f} | "
            f"{r['median_op_us']:.1f} |"
        )
    return "\n".join(lines)


def render(result: dict) -> str:
    """Human-readable report: verdict, why, fixes, the decision path, per-rank table, topology advice."""
    if result.get("verdict") is None:
        return f"triage: no verdict: {result.get('reason')}\n{result.get('topology_advice', TOPOLOGY)}"
    out = [
        f"verdict: {result['verdict']}: {result['reason']}",
        f"straggler spread {result['straggler_spread']:.1%} (slowest rank {result['slowest_rank']}), "
        f"mean step {result['step_ms']:.1f} ms over {result['world_size']} rank(s)",
        "fixes:",
    ] + [f"  - {f}" for f in result["fixes"]]
    out += ["decision path:"] + [f"  {i + 1}. {p}" for i, p in enumerate(result["decision_path"])]
    out += ["per rank (per step):", markdown_table(result), result["topology_advice"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m training.triage",
        description="Triage torch.profiler Chrome traces: where each rank's step time goes.",
    )
    ap.add_argument("paths", nargs="+", help="trace files or directories holding *.pt.trace.json")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--processes-per-node", type=int)
    ap.add_argument("--sharding", choices=["full", "hybrid", "none"])
    args = ap.parse_args(argv)
    files = [f for p in args.paths for f in trace_files(p)]
    if not files:
        print(f"no trace files under {args.paths}", file=sys.stderr)
        return 1
    ctx = {"nodes": args.nodes, "processes_per_node": args.processes_per_node, "sharding": args.sharding}
    result = triage_files(files, ctx if args.nodes else None)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
