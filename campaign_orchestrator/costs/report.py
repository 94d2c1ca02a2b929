"""Cost per result: the ledger's lines for the stage outputs a result was built from, rolled up
into the figures a team compares, next to the planner's estimates.

Figures (``cost_per_result``):

* ``total_usd`` and its split by what the money bought: teacher, training, evaluation. The
  result's cost is every line paid for the stage outputs it used, in whichever run they were
  produced (a cached stage is part of the result's cost but not of this run's spend,
  ``spent_this_run_usd``), including the spend of attempts a budget stopped (``interrupted_usd``).
* ``usd_per_million_teacher_tokens``: teacher spend / (prompt + completion tokens / 1e6); on-policy training
  adds the tokens the teacher prefilled to score the student's samples (``on_policy_scoring`` lines).
* ``usd_per_1k_accepted_examples``: teacher spend (what making the training data cost; rejected
  generations are paid for too) × 1000 / examples that passed the filters.
* ``usd_per_point_gained_lcb``: total / (lower 95% bound of candidate − base, in percentage
  points): the price of the gain the evaluation can vouch for. ``None`` — "not meaningful" —
  when that bound is ≤ 0 (no gain shown). ``usd_per_point_gained`` uses the point estimate.
* ``gpu_hours``, ``host_hours``; ``teacher_tokens_per_s``, ``training_tokens_per_s``.
* ``teachers`` (several teachers routed by category; None with one): each teacher's spend in the result from its
  tagged ledger lines (generations, scoring in evaluation, replay, budget-stopped attempts), its categories, rows
  and tokens, and why its budget share stopped it (:func:`teacher_spend`).

The gain's interval comes from the evaluation when it provides one (a ``delta_ci`` field, per
suite in ``gate.json`` or the manifest) and otherwise from a paired 95% t-interval over the
per-item score differences in ``items.parquet`` (:func:`paired_gain_interval`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

SPEND_KINDS = ("teacher", "training", "evaluation")
SPEND_STAGES = {"teacher_generations": "teacher", "student_adapter": "training", "evaluation": "evaluation"}
NOT_MEANINGFUL = "not meaningful (the lower bound of the gain over base is ≤ 0)"


# --------------------------------------------------------------------------- gain interval


def paired_gain_interval(items_path: str | Path, suite: str, confidence: float = 0.95) -> dict | None:
    """Paired t-interval of candidate − base over items both scored (same item ids) in ``suite``."""
    import pyarrow.parquet as pq
    from scipy import stats

    t = pq.read_table(items_path, columns=["suite", "model", "item_id", "score"]).to_pylist()
    by: dict[str, dict[str, float]] = defaultdict(dict)
    for r in t:
        if r["suite"] == suite and r["score"] is not None and r["model"] in ("candidate", "base"):
            by[r["model"]][r["item_id"]] = float(r["score"])
    ids = sorted(set(by["candidate"]) & set(by["base"]))
    if not ids:
        return None
    d = [by["candidate"][i] - by["base"][i] for i in ids]
    n = len(d)
    mean = sum(d) / n
    if n < 2:
        return {"n": n, "mean": mean, "low": None, "high": None, "method": "paired t (too few items)"}
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return {
        "n": n,
        "mean": mean,
        "low": mean - half,
        "high": mean + half,
        "method": f"paired t, {confidence:.0%}, computed from items.parquet",
    }


def _ci_pair(v) -> tuple[float, float] | None:
    if isinstance(v, list | tuple) and len(v) == 2:
        return float(v[0]), float(v[1])
    if isinstance(v, dict):
        for lo, hi in (("low", "high"), ("lo", "hi"), ("lower", "upper")):
            if lo in v and hi in v:
                return float(v[lo]), float(v[hi])
    return None


def gain_interval(evaluation: dict, suite: str) -> dict | None:
    """candidate − base for ``suite`` with its 95% interval: the evaluation's own ``delta_ci``
    when present (gate.json suites or the manifest), else computed from items.parquet."""
    sources = []
    gate_path = evaluation.get("gate_path")
    if gate_path and Path(gate_path).exists():
        gate = json.loads(Path(gate_path).read_text())
        sources += [s for s in gate.get("suites", []) if s.get("suite") == suite]
    if isinstance(evaluation.get("delta_ci"), dict):
        sources.append({"delta_ci": evaluation["delta_ci"].get(suite)})
    for s in sources:
        pair = _ci_pair(s.get("delta_ci"))
        if pair is not None:
            mean = s.get("delta")
            mean = mean.get("estimate", mean.get("mean")) if isinstance(mean, dict) else mean
            if mean is None:
                c, b = s.get("candidate", {}).get("score"), s.get("base", {}).get("score")
                mean = c - b if c is not None and b is not None else (pair[0] + pair[1]) / 2
            return {
                "n": s.get("n"),
                "mean": float(mean),
                "low": pair[0],
                "high": pair[1],
                "method": "delta_ci from the evaluation",
            }
    items = evaluation.get("items_path")
    return paired_gain_interval(items, suite) if items and Path(items).exists() else None


# --------------------------------------------------------------------------- cost per result


def _div(a: float, b: float | None) -> float | None:
    return a / b if b else None


def cost_per_result(
    lines: list[dict],
    *,
    accepted_examples: int,
    teacher_tokens: int,
    gain: dict | None,
    teacher_seconds: float | None = None,
    training_tokens: int | None = None,
    training_seconds: float | None = None,
    unknown: dict[str, str] | None = None,
) -> dict:
    """The cost-per-result figures from ledger lines (fields ``kind``, ``usd``, ``unit``,
    ``quantity``, ``status``) and the result's counts (see the module docstring). ``unknown``: spend
    kind -> why its cost is unknown (an unpriced teacher); every figure that depends on it is None,
    shown "unknown", never $0."""
    by_kind: dict[str, float] = defaultdict(float)
    qty: dict[str, float] = defaultdict(float)
    for line in lines:
        by_kind[line["kind"]] += float(line["usd"])
        qty[line["unit"]] += float(line["quantity"])
    total = float(sum(by_kind.values()))
    teacher = by_kind.get("teacher", 0.0)
    mean_pts = None if gain is None else gain["mean"] * 100
    low_pts = None if gain is None or gain.get("low") is None else gain["low"] * 100
    out = {
        "total_usd": total,
        **{f"{k}_usd": by_kind.get(k, 0.0) for k in SPEND_KINDS},
        "other_usd": float(sum(v for k, v in by_kind.items() if k not in SPEND_KINDS)),
        "interrupted_usd": float(sum(float(x["usd"]) for x in lines if x.get("status") == "interrupted")),
        # paid, usage unknown: requests in flight when a Ray worker was lost, at their upper bound
        "unverified_usd": float(sum(float(x["usd"]) for x in lines if x.get("verified") is False)),
        "teacher_tokens": teacher_tokens,
        "usd_per_million_teacher_tokens": _div(teacher, teacher_tokens / 1e6 if teacher_tokens else None),
        "accepted_examples": accepted_examples,
        "usd_per_1k_accepted_examples": _div(teacher * 1000, accepted_examples),
        "gain_points": mean_pts,
        "gain_points_low": low_pts,
        "gain_points_high": None if gain is None or gain.get("high") is None else gain["high"] * 100,
        "gain_items": None if gain is None else gain.get("n"),
        "gain_method": None if gain is None else gain.get("method"),
        "usd_per_point_gained": total / mean_pts if mean_pts and mean_pts > 0 else None,
        "usd_per_point_gained_lcb": total / low_pts if low_pts is not None and low_pts > 0 else None,
        "gpu_hours": qty.get("gpu-hour", 0.0),
        "host_hours": qty.get("host-hour", 0.0),
        "teacher_tokens_per_s": _div(teacher_tokens, teacher_seconds),
        "training_tokens_per_s": _div(training_tokens or 0, training_seconds),
    }
    out["per_point_note"] = (
        NOT_MEANINGFUL
        if out["usd_per_point_gained_lcb"] is None and gain is not None
        else "no evaluation"
        if gain is None
        else ""
    )
    out["unknown_costs"] = [f"{k}: {why}" for k, why in sorted((unknown or {}).items())]
    if unknown:
        out["known_usd"] = total
        for k in unknown:
            out[f"{k}_usd"] = None
        out |= {
            "total_usd": None,
            "usd_per_point_gained": None,
            "usd_per_point_gained_lcb": None,
            "per_point_note": "unknown (" + "; ".join(out["unknown_costs"]) + ")",
        }
        if "teacher" in unknown:
            out |= {"usd_per_million_teacher_tokens": None, "usd_per_1k_accepted_examples": None}
    return out


def student_teacher_ratio(scores: dict, suite: str) -> float | None:
    """candidate ÷ teacher on ``suite`` (None: the teacher was not scored, or scored 0)."""
    cand, teacher = scores.get("candidate", {}).get(suite), scores.get("teacher", {}).get(suite)
    return cand / teacher if cand is not None and teacher else None


def unknown_costs(manifests: dict[str, dict]) -> dict[str, str]:
    """Spend kind -> why it is unknown, from the stage manifests' ``cost_unknown`` (an unpriced teacher)."""
    out = {}
    for stage, m in manifests.items():
        if m and m.get("cost_unknown"):
            kind = SPEND_STAGES.get(stage, stage)
            out[kind] = f"{stage} {m['cost_unknown']}"
    return out


TEACHER_ASSETS = {
    "teacher_generations": "generations_usd",
    "evaluation": "scoring_usd",
    "distillation_set": "replay_usd",
}


def teacher_spend(lines: list[dict], generations: dict) -> dict[str, dict] | None:
    """Per teacher of a campaign with several (None otherwise): what its tagged lines cost in this result, split by
    what it did (``generations_usd``, ``scoring_usd`` in evaluation, ``replay_usd``; ``interrupted_usd``: attempts a
    budget stopped), with its categories, rows and tokens from the teacher stage's manifest (``generations``) and
    why its budget share stopped it; ``usd`` None: unpriced (unknown, never $0)."""
    per = generations.get("teachers") or {}
    tagged = [x for x in lines if x.get("teacher")]
    if not per and not tagged:
        return None
    out: dict[str, dict] = {}
    for name, t in per.items():
        out[name] = {
            "categories": t.get("categories"),
            "rows": t.get("rows", 0),
            "prompt_tokens": t.get("prompt_tokens", 0),
            "completion_tokens": t.get("completion_tokens", 0),
            "usd": 0.0,
            **{k: 0.0 for k in TEACHER_ASSETS.values()},
            "interrupted_usd": 0.0,
            **({"stopped": t["stopped"]} if t.get("stopped") else {}),
        }
    for x in tagged:
        d = out.setdefault(
            x["teacher"], {"usd": 0.0, **{k: 0.0 for k in TEACHER_ASSETS.values()}, "interrupted_usd": 0.0}
        )
        usd = float(x["usd"])
        d["usd"] += usd
        what = TEACHER_ASSETS.get(x.get("asset"), f"{x.get('asset')}_usd")
        d[what] = d.get(what, 0.0) + usd
        if x.get("status") == "interrupted":
            d["interrupted_usd"] += usd
    for name, t in per.items():
        if t.get("rows") and t.get("usd") is None:  # an unpriced teacher's spend is unknown
            out[name] |= {"usd": None, "generations_usd": None}
    return out


def plan_vs_actual(
    plan: dict | None, lines: list[dict], manifests: dict[str, dict], reused: dict[str, str] | None = None
) -> list[dict]:
    """Per spending stage: the planner's estimate next to what the ledger and manifests recorded; ``reused``:
    stage -> the run that produced the output this run reused (its actuals are that run's, not this one's)."""
    rows = []
    for stage, kind in SPEND_STAGES.items():
        m = manifests.get(stage) or {}
        actual = None if m.get("cost_unknown") else float(sum(float(x["usd"]) for x in lines if x["asset"] == stage))
        est = (plan or {}).get("stages", {}).get(stage) or {}
        tokens = (
            m.get("prompt_tokens", 0) + m.get("completion_tokens", 0)
            if stage == "teacher_generations"
            else (m.get("summary") or {}).get("tokens")
            if stage == "student_adapter"
            else None
        )
        rows.append(
            {
                "stage": stage,
                "kind": kind,
                "estimated_usd": est.get("usd"),
                "actual_usd": actual,
                "usd_ratio": actual / est["usd"] if est.get("usd") and actual is not None else None,
                "estimated_seconds": est.get("seconds"),
                "actual_seconds": m.get("wall_seconds"),
                "estimated_tokens": est.get("tokens"),
                "actual_tokens": tokens,
                "reused_from_run": (reused or {}).get(stage),
            }
        )
    return rows


def build_report(
    *,
    campaign: str,
    run_id: str,
    ledger,
    manifests: dict[str, dict],
    primary_suite: str,
    plan: dict | None = None,
    budget_usd: float | None = None,
    budget_scope: str = "campaign",
) -> dict:
    """The cost report of one campaign run, from the ledger and the stage manifests it used.
    ``manifests`` maps stage names to their manifests (missing stages are simply absent)."""
    outputs = {stage: m["key"] for stage, m in manifests.items() if m and "key" in m}
    lines = ledger.lineage_lines(campaign, outputs)
    gen = manifests.get("teacher_generations") or {}
    dist = manifests.get("distillation_set") or {}
    adapter = (manifests.get("student_adapter") or {}).get("summary") or {}
    ev = manifests.get("evaluation")
    gain = gain_interval(ev, primary_suite) if ev else None
    unknown = unknown_costs(manifests)
    # on-policy training pays the teacher for prefills of the student's samples (its own ledger lines, per round)
    scored = int((adapter.get("on_policy") or {}).get("teacher_prefill_tokens", 0))
    figures = cost_per_result(
        lines,
        accepted_examples=int(dist.get("rows", 0)),
        teacher_tokens=int(gen.get("prompt_tokens", 0) + gen.get("completion_tokens", 0)) + scored,
        gain=gain,
        teacher_seconds=gen.get("wall_seconds"),
        training_tokens=adapter.get("tokens"),
        training_seconds=adapter.get("train_seconds"),
        unknown=unknown,
    )
    spent_run = ledger.spent(campaign, run_id=run_id)
    spent_all = ledger.spent(campaign)
    if unknown:  # what an unpriced stage cost is unknown wherever it was paid: the campaign, and its producing run
        spent_all = None
        made_here = ledger.assets_materialized(campaign, run_id, produced_only=True)
        if made_here & {s for s, m in manifests.items() if m and m.get("cost_unknown")}:
            spent_run = None
    spent_scope = spent_run if budget_scope == "run" else spent_all
    scores = (ev or {}).get("scores", {})
    report = {
        "campaign": campaign,
        "run_id": run_id,
        **figures,
        "spent_this_run_usd": spent_run,
        "campaign_spent_usd": spent_all,
        "budget_usd": budget_usd,
        "budget_scope": budget_scope,
        "budget_remaining_usd": None if budget_usd is None or spent_scope is None else budget_usd - spent_scope,
        "budget_used_fraction": None if budget_usd is None or spent_scope is None else spent_scope / budget_usd,
        "candidate_score": scores.get("candidate", {}).get(primary_suite),
        "suite_scores": dict(scores.get("candidate", {})),
        "base_suite_scores": dict(scores.get("base", {})),
        "base_score": scores.get("base", {}).get(primary_suite),
        "teacher_score": scores.get("teacher", {}).get(primary_suite),
        "student_teacher_ratio": student_teacher_ratio(scores, primary_suite),
        "verdict": (ev or {}).get("verdict"),
        "primary_suite": primary_suite,
        "stage_keys": outputs,
        "teachers": teacher_spend(lines, gen),
        "teacher_cache_hits": int((gen.get("stats") or {}).get("cache_hits", 0)),
        "teacher_generations": int(gen.get("rows", 0)),
        "plan_vs_actual": plan_vs_actual(plan, lines, manifests, reused_stages(ledger, campaign, run_id)),
        "plan_total_usd": None if plan is None else plan.get("total_usd"),
        "plan_memory_gb": None if plan is None else plan["memory"]["total_gb"],
        "plan_fits": None if plan is None else plan["memory"].get("fits"),
    }
    peak = adapter.get("peak_memory_mb")
    report["actual_peak_memory_gb"] = None if peak is None else peak * 2**20 / 1e9
    return report


def reused_stages(ledger, campaign: str, run_id: str) -> dict[str, str]:
    """Stage -> the run whose actuals the stage's output of ``run_id`` shows: the run that produced an output
    ``run_id`` reused (a cache hit: it ran nothing for it), or the run that paid for the lines an output carries
    (a re-judgement of answers that run paid for: this run spent nothing on them)."""
    return ledger.carried_from(campaign, run_id) | ledger.reused_from(campaign, run_id)


# --------------------------------------------------------------------------- rendering


def dollars(x: float | None) -> str:
    """Dollars for people: two significant digits under $1 (``$0.00052``), cents to $1,000, then ``$1.2k``,
    ``$3.4M``; ``$0`` for nothing, ``n/a`` for unknown."""
    if x is None:
        return "n/a"
    if x == 0:
        return "$0"
    sign, a = ("-" if x < 0 else ""), abs(x)
    if a >= 1e6:
        return f"{sign}${a / 1e6:.1f}M"
    if a >= 1e3:
        return f"{sign}${a / 1e3:.1f}k"
    if a >= 1:
        return f"{sign}${a:,.2f}"
    digits = max(2, -math.floor(math.log10(a)) + 1)
    text = f"{a:.{digits}f}"
    text = text.rstrip("0") if digits > 2 else text  # $0.001, not $0.0010
    return f"{sign}${text}" if float(text) < 1 else f"{sign}$1.00"


def seconds(x: float | None) -> str:
    """Seconds for people: ``0.4 s``, ``21.8 s``, ``3 min 05 s``, ``1 h 02 min``."""
    if x is None:
        return "n/a"
    if x < 60:
        return f"{x:.1f} s"
    m, sec = divmod(round(x), 60)
    return f"{m} min {sec:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def money(x: float | None, digits: int = 6) -> str:
    return "n/a" if x is None else f"${x:,.{digits}f}"


def usd(r: dict, key: str, digits: int = 6) -> str:
    """A dollar figure of report ``r``: "unknown" when it depends on an unpriced cost, never $0."""
    if r.get(key) is None and r.get("unknown_costs"):
        return "unknown"
    return money(r.get(key), digits)


def per_point_text(r: dict) -> str:
    if r.get("unknown_costs") and r.get("gain_points") is not None:
        return f"per point gained: unknown ({'; '.join(r['unknown_costs'])})"
    if r.get("usd_per_point_gained_lcb") is not None:
        return (
            f"{money(r['usd_per_point_gained_lcb'])} per point gained over base at the gain's lower 95% bound "
            f"({r['gain_points_low']:+.1f} points; point estimate {r['gain_points']:+.1f} → "
            f"{money(r['usd_per_point_gained'])} per point)"
        )
    if r.get("gain_points") is None:
        return "per point gained: no evaluation in this result"
    low = r.get("gain_points_low")
    return (
        f"per point gained: not meaningful (gain {r['gain_points']:+.1f} points, lower 95% bound "
        f"{'n/a' if low is None else f'{low:+.1f}'} ≤ 0)"
    )


def render_text(r: dict) -> list[str]:
    """The summary lines ``campaign run`` prints."""
    out = [
        f"cost of this result: {usd(r, 'total_usd')} (teacher {usd(r, 'teacher_usd')}, training "
        f"{usd(r, 'training_usd')}, evaluation {usd(r, 'evaluation_usd')})"
        + (f", of which {money(r['interrupted_usd'])} in budget-stopped attempts" if r.get("interrupted_usd") else "")
        + (
            f", of which {money(r['unverified_usd'])} ({r['unverified_usd'] / r['total_usd']:.1%}) paid-unverified "
            "(requests in flight when a Ray worker was lost, at their upper bound)"
            if r.get("unverified_usd") and r.get("total_usd")
            else ""
        )
        + (
            f"; unknown: {'; '.join(r['unknown_costs'])} (priced stages {money(r.get('known_usd'))})"
            if r.get("unknown_costs")
            else ""
        ),
        f"spent in this run: {usd(r, 'spent_this_run_usd')}"
        + (
            f"; campaign total {usd(r, 'campaign_spent_usd')}"
            if r["campaign_spent_usd"] != r["spent_this_run_usd"]
            else ""
        ),
        f"cost per result: {usd(r, 'usd_per_million_teacher_tokens')} per M teacher tokens ({r['teacher_tokens']:,} "
        f"tokens); {usd(r, 'usd_per_1k_accepted_examples')} per 1k accepted examples ({r['accepted_examples']:,})",
    ]
    if r.get("teachers"):
        out.append("spend per teacher: " + "; ".join(_teacher_text(n, t) for n, t in r["teachers"].items()))
    if r.get("teacher_cache_hits"):
        out.append(
            f"  {r['teacher_cache_hits']:,} of {r.get('teacher_generations') or r['teacher_cache_hits']:,} teacher "
            "generations came from the content-addressed cache (paid for when first generated, not again)"
        )
    out += [
        f"  {per_point_text(r)}",
        f"  {r['gpu_hours']:.6f} GPU-hours, {r['host_hours']:.6f} host-hours; teacher "
        f"{_num(r.get('teacher_tokens_per_s'))} tokens/s, training {_num(r.get('training_tokens_per_s'))} tokens/s",
    ]
    if r.get("budget_usd") is not None and r.get("budget_used_fraction") is not None:
        out.append(
            f"budget ({r['budget_scope']}): {money(r['budget_usd'], 2)}, used {r['budget_used_fraction']:.2%}, "
            f"{money(r['budget_remaining_usd'])} remains"
        )
    if r.get("plan_total_usd") is not None:
        out.append("plan vs actual:  stage                 estimate      actual    ratio   est. s  actual s")
        for p in r["plan_vs_actual"]:
            ratio = "n/a" if p["usd_ratio"] is None else f"{p['usd_ratio']:.2f}×"
            src = p.get("reused_from_run")
            out.append(
                f"                 {p['stage']:20s} {money(p['estimated_usd']):>11s} {money(p['actual_usd']):>11s} "
                f"{ratio:>7s} {_num(p['estimated_seconds']):>8s} {_num(p['actual_seconds']):>9s}"
                + (f"  reused (actuals of run {str(src)[:8]})" if src else "")
            )
    return out


def _teacher_text(name: str, t: dict) -> str:
    """One teacher's spend for people: ``char $0.00027 (short; 27 rows; generations $0.00027, scoring $0)``."""
    cats = "the rest" if t.get("categories") is None else ", ".join(t["categories"])
    parts = [f"generations {money(t.get('generations_usd'))}"]
    parts += [f"{k.removesuffix('_usd')} {money(t[k])}" for k in ("scoring_usd", "replay_usd") if t.get(k)]
    if t.get("interrupted_usd"):
        parts.append(f"of which {money(t['interrupted_usd'])} in a stopped attempt")
    stopped = f"; STOPPED: {t['stopped']}" if t.get("stopped") else ""
    usd = "unknown (unpriced)" if t.get("usd") is None else money(t["usd"])
    return f"{name} {usd} ({cats}; {t.get('rows', 0):,} rows; {', '.join(parts)}){stopped}"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.1f}"


def render_markdown(r: dict) -> str:
    rows = [
        ("total", usd(r, "total_usd")),
        ("teacher", usd(r, "teacher_usd")),
        ("training", usd(r, "training_usd")),
        ("evaluation", usd(r, "evaluation_usd")),
        ("spent in this run", usd(r, "spent_this_run_usd")),
        ("$ / M teacher tokens", usd(r, "usd_per_million_teacher_tokens")),
        ("$ / 1k accepted examples", usd(r, "usd_per_1k_accepted_examples")),
        (
            "$ / point gained (lower bound)",
            usd(r, "usd_per_point_gained_lcb")
            if r["usd_per_point_gained_lcb"] is not None or r.get("unknown_costs")
            else "not meaningful",
        ),
        (
            "gain over base (points, 95% CI)",
            "n/a"
            if r["gain_points"] is None
            else f"{r['gain_points']:+.1f} [{_num(r['gain_points_low'])}, {_num(r['gain_points_high'])}]",
        ),
        ("GPU-hours / host-hours", f"{r['gpu_hours']:.6f} / {r['host_hours']:.6f}"),
    ]
    rows[2:2] = [(f"teacher `{n}`", _teacher_text(n, t).split(" ", 1)[1]) for n, t in (r.get("teachers") or {}).items()]
    md = ["| figure | value |", "|---|---:|"] + [f"| {a} | {b} |" for a, b in rows]
    if r.get("plan_total_usd") is not None:
        md += ["", "| stage | estimated | actual | ratio |", "|---|---:|---:|---:|"]
        for p in r["plan_vs_actual"]:
            ratio = "n/a" if p["usd_ratio"] is None else f"{p['usd_ratio']:.2f}×"
            reused = f" (reused from run {str(p['reused_from_run'])[:8]})" if p.get("reused_from_run") else ""
            md.append(f"| {p['stage']}{reused} | {money(p['estimated_usd'])} | {money(p['actual_usd'])} | {ratio} |")
    return "\n".join(md)
