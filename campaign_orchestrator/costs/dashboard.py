"""The cost dashboard: one self-contained HTML page per campaign, drawn from the ledger.

Headline tiles (latest result's cost per result, spend, budget), then four charts in inline SVG
(no scripts, no network): cumulative spend over time against the budget (budget burn), spend
per run split by stage, result cost against the candidate's score, and the planner's estimates
against the actuals; then the runs table. Hovering a mark shows its numbers (SVG ``<title>``).
Pure Python: the page is a string; ``write_dashboard`` writes it atomically.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
import os
from pathlib import Path

from campaign_orchestrator.costs.report import dollars

COLORS = {
    "teacher": "#6366f1",
    "training": "#f59e0b",
    "evaluation": "#10b981",
    "interrupted": "#ef4444",
    "budget": "#dc2626",
    "line": "#2563eb",
    "GO": "#16a34a",
    "NO-GO": "#dc2626",
    "INCONCLUSIVE": "#a3a3a3",
}

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;background:#f6f7fb;color:#1f2937}
header{background:#111827;color:#f9fafb;padding:18px 28px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#9ca3af;font-size:13px}
main{padding:20px 28px;max-width:1280px}
.tiles{display:grid;grid-template-columns:repeat(auto-fit,minmax(180px,1fr));gap:12px;margin-bottom:18px}
.tile{background:#fff;border-radius:10px;padding:14px 16px;box-shadow:0 1px 3px rgba(0,0,0,.08)}
.tile .label{font-size:12px;color:#6b7280;text-transform:uppercase;letter-spacing:.04em}
.tile .value{font-size:24px;font-weight:650;margin-top:4px}.tile .sub{font-size:12px;color:#6b7280;margin-top:2px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:14px}
.card{background:#fff;border-radius:10px;padding:14px 16px;box-shadow:0 1px 3px rgba(0,0,0,.08)}
.card h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{padding:6px 8px;border-bottom:1px solid #eef0f4;text-align:right}
th:first-child,td:first-child{text-align:left}th{color:#6b7280;font-weight:600}
.legend span{display:inline-block;margin-right:12px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
.warn{color:#b91c1c;font-weight:600}.muted{color:#9ca3af}
svg text{font-size:11px;fill:#4b5563}
"""


def _usd(r: dict, key: str) -> str:
    """A dollar figure of report ``r`` for people: "unknown" when it depends on an unpriced cost, never $0."""
    return "unknown" if r.get(key) is None and r.get("unknown_costs") else dollars(r.get(key))


def _e(x) -> str:
    return html.escape(str(x))


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int(math.ceil((hi - start) / step)) + 1)]


def _usd_axis(ticks: list[float]):
    """A formatter with as many decimals as the tick step needs: $0.005, $0.25, $5, $1,000."""
    step = (ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    exp = math.floor(math.log10(step))
    decimals = max(0, -exp + (1 if round(step / 10**exp, 6) == 2.5 else 0))
    if 0 < decimals < 2:
        decimals = 2
    return lambda v: "$0" if v == 0 else f"${v:,.{decimals}f}"


class _Plot:
    """A plot area with linear axes; marks are added as SVG strings."""

    def __init__(self, w: int = 560, h: int = 260, left: int = 64, bottom: int = 34, top: int = 12, right: int = 28):
        self.w, self.h, self.l, self.b, self.t, self.r = w, h, left, bottom, top, right
        self.parts: list[str] = []

    def axes(self, xlo, xhi, ylo, yhi, xfmt, yfmt, xlabel="", ylabel=""):
        self.xt, self.yt = _ticks(xlo, xhi), _ticks(ylo, yhi)
        xfmt = _usd_axis(self.xt) if xfmt == "usd" else xfmt
        yfmt = _usd_axis(self.yt) if yfmt == "usd" else yfmt
        self.x0, self.x1, self.y0, self.y1 = self.xt[0], self.xt[-1], self.yt[0], self.yt[-1]
        for y in self.yt:
            py = self.py(y)
            self.parts.append(
                f'<line x1="{self.l}" x2="{self.w - self.r}" y1="{py:.1f}" y2="{py:.1f}" stroke="#eef0f4"/>'
                f'<text x="{self.l - 6}" y="{py + 4:.1f}" text-anchor="end">{_e(yfmt(y))}</text>'
            )
        for x in self.xt:
            px = self.px(x)
            self.parts.append(
                f'<text x="{px:.1f}" y="{self.h - self.b + 16}" text-anchor="middle">{_e(xfmt(x))}</text>'
            )
        self.parts.append(
            f'<line x1="{self.l}" x2="{self.w - self.r}" y1="{self.h - self.b}" y2="{self.h - self.b}" '
            'stroke="#9ca3af"/>'
        )
        if xlabel:
            self.parts.append(
                f'<text x="{(self.l + self.w - self.r) / 2}" y="{self.h - 4}" text-anchor="middle">{_e(xlabel)}</text>'
            )
        if ylabel:
            self.parts.append(
                f'<text transform="translate(12,{(self.t + self.h - self.b) / 2}) rotate(-90)" '
                f'text-anchor="middle">{_e(ylabel)}</text>'
            )

    def px(self, x: float) -> float:
        return self.l + (x - self.x0) / ((self.x1 - self.x0) or 1) * (self.w - self.l - self.r)

    def py(self, y: float) -> float:
        return self.h - self.b - (y - self.y0) / ((self.y1 - self.y0) or 1) * (self.h - self.b - self.t)

    def svg(self, label: str) -> str:
        return (
            f'<svg viewBox="0 0 {self.w} {self.h}" width="100%" role="img" aria-label="{_e(label)}">'
            + "".join(self.parts)
            + "</svg>"
        )


def _empty(msg: str) -> str:
    return f'<p class="muted">{_e(msg)}</p>'


def chart_spend_over_time(lines: list[dict], budget: float | None) -> str:
    if not lines:
        return _empty("no spend recorded yet")
    pts, cum = [], 0.0
    for x in sorted(lines, key=lambda r: str(r["recorded_at"])):
        cum += float(x["usd"])
        pts.append((_ts(x["recorded_at"]), cum, x))
    t0 = pts[0][0]
    xs = [(p[0] - t0) / 60 for p in pts]
    on_scale = budget is not None and budget <= 3 * cum  # a far-away budget would flatten the spend to a line
    top = max(cum, budget if on_scale else 0.0) * 1.1
    p = _Plot()
    p.axes(0, max(xs[-1], 1e-3), 0, top, lambda v: f"{v:g}", "usd", "minutes since the first spend", "cumulative USD")
    if budget is not None and not on_scale:
        p.parts.append(
            f'<text x="{p.w - p.r - 4}" y="{p.t + 12}" text-anchor="end" style="fill:{COLORS["budget"]}">'
            f"budget {_e(dollars(budget))} is off this scale ({cum / budget:.1%} used)</text>"
        )
    if on_scale:
        by = p.py(budget)
        p.parts.append(
            f'<line x1="{p.l}" x2="{p.w - p.r}" y1="{by:.1f}" y2="{by:.1f}" stroke="{COLORS["budget"]}" '
            f'stroke-dasharray="6 4"><title>budget {dollars(budget)}</title></line>'
            f'<text x="{p.w - p.r - 4}" y="{by - 5:.1f}" text-anchor="end" style="fill:{COLORS["budget"]}">'
            f"budget {_e(dollars(budget))}</text>"
        )
    path = " ".join(
        f"{'M' if i == 0 else 'L'}{p.px(x):.1f},{p.py(y):.1f}"
        for i, (x, (_, y, _l)) in enumerate(zip(xs, pts, strict=True))
    )
    p.parts.append(f'<path d="{path}" fill="none" stroke="{COLORS["line"]}" stroke-width="2"/>')
    for x, (_, y, line) in zip(xs, pts, strict=True):
        color = COLORS["interrupted"] if line.get("status") == "interrupted" else COLORS.get(line["kind"], "#6b7280")
        p.parts.append(
            f'<circle cx="{p.px(x):.1f}" cy="{p.py(y):.1f}" r="4" fill="{color}"><title>'
            f"{_e(line['asset'])} ({_e(line['status'])}) {_e(dollars(float(line['usd'])))} · run "
            f"{_e(str(line['run_id'])[:8])} · cumulative {_e(dollars(y))}</title></circle>"
        )
    return p.svg("cumulative spend over time")


def chart_runs_by_stage(runs: list[dict]) -> str:
    runs = [r for r in runs if r["usd"] > 0] or runs
    if not runs:
        return _empty("no runs recorded yet")
    row_h, left, w = 26, 90, 560
    top = max(r["usd"] for r in runs) or 1.0
    ticks = _ticks(0, top)
    fmt = _usd_axis(ticks)
    scale = (w - left - 90) / ticks[-1]  # room on the right for the total
    h = 30 + row_h * len(runs)
    parts = []
    for t in ticks:
        x = left + t * scale
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="4" y2="{h - 24}" stroke="#eef0f4"/>'
            f'<text x="{x:.1f}" y="{h - 8}" text-anchor="middle">{_e(fmt(t))}</text>'
        )
    for i, r in enumerate(runs):
        y, x = 8 + i * row_h, float(left)
        parts.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{_e(str(r["run_id"])[:8])}</text>')
        # per-stage segments are completed spend; budget-stopped attempts get their own segment
        segs = [(k, r[f"{k}_usd"]) for k in ("teacher", "training", "evaluation")] + [
            ("interrupted", r["interrupted_usd"])
        ]
        for k, v in segs:
            if v <= 0:
                continue
            parts.append(
                f'<rect x="{x:.1f}" y="{y}" width="{max(v * scale, 1):.1f}" height="{row_h - 8}" fill="{COLORS[k]}">'
                f"<title>run {_e(r['run_id'])}: {k} {_e(dollars(v))}</title></rect>"
            )
            x += v * scale
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 14}">{_e(dollars(r["usd"]))}</text>')
    legend = "".join(
        f'<span><i style="background:{COLORS[k]}"></i>{k}</span>'
        for k in ("teacher", "training", "evaluation", "interrupted")
    )
    return (
        f'<div class="legend">{legend}</div><svg viewBox="0 0 {w} {h}" width="100%" role="img" '
        f'aria-label="spend per run by stage">{"".join(parts)}</svg>'
    )


def chart_cost_vs_score(reports: list[dict]) -> str:
    pts = [
        r["report"]
        for r in reports
        if r["report"].get("candidate_score") is not None and r["report"].get("total_usd") is not None
    ]  # a result of unknown cost has no place on the cost axis
    if not pts:
        return _empty("no evaluated result yet")
    xs = [float(r["total_usd"]) for r in pts]
    p = _Plot()
    p.axes(0, max(xs) * 1.1 or 1e-6, 0, 100, "usd", lambda v: f"{v:g}%", "cost of the result (USD)", "candidate score")
    base = [r["base_score"] for r in pts if r.get("base_score") is not None]
    if base:
        by = p.py(base[-1] * 100)
        p.parts.append(
            f'<line x1="{p.l}" x2="{p.w - p.r}" y1="{by:.1f}" y2="{by:.1f}" stroke="#9ca3af" stroke-dasharray="3 3"/>'
            f'<text x="{p.l + 4}" y="{by - 4:.1f}">base {base[-1]:.0%}</text>'
        )
    for r, x in zip(pts, xs, strict=True):
        color = COLORS.get(r.get("verdict") or "", "#6b7280")
        per = (
            dollars(r["usd_per_point_gained_lcb"]) + "/point (lower bound)"
            if r.get("usd_per_point_gained_lcb")
            else "$/point not meaningful"
        )
        p.parts.append(
            f'<circle cx="{p.px(x):.1f}" cy="{p.py(r["candidate_score"] * 100):.1f}" r="6" fill="{color}" '
            f'fill-opacity=".85"><title>run {_e(str(r["run_id"])[:8])}: {_e(dollars(x))}, score '
            f"{r['candidate_score']:.1%}, {_e(r.get('verdict'))}, {_e(per)}</title></circle>"
        )
    return p.svg("result cost against candidate score")


def chart_budget(spent: float, budget: float | None) -> str:
    if budget is None:
        return _empty("no budget set (cost.budget_usd)")
    frac = spent / budget
    w = 560
    fill = min(frac, 1.0) * (w - 20)
    color = COLORS["budget"] if frac >= 0.9 else COLORS["line"]
    return (
        f'<svg viewBox="0 0 {w} 56" width="100%" role="img" aria-label="budget burn">'
        f'<rect x="10" y="8" width="{w - 20}" height="22" rx="4" fill="#eef0f4"/>'
        f'<rect x="10" y="8" width="{fill:.1f}" height="22" rx="4" fill="{color}"><title>{_e(dollars(spent))} of '
        f"{_e(dollars(budget))}</title></rect>"
        f'<text x="10" y="48">{_e(dollars(spent))} spent of {_e(dollars(budget))} ({frac:.2%}); '
        f"{_e(dollars(max(0.0, budget - spent)))} remains</text></svg>"
    )


def chart_plan_vs_actual(report: dict | None) -> str:
    if not report or report.get("plan_total_usd") is None:
        return _empty("no plan to compare with")
    rows = ""
    for p in report["plan_vs_actual"]:
        ratio = "n/a" if p["usd_ratio"] is None else f"{p['usd_ratio']:.2f}×"
        reused = f" (reused from run {str(p['reused_from_run'])[:8]})" if p.get("reused_from_run") else ""
        rows += (
            f"<tr><td>{_e(p['stage'] + reused)}</td><td>{_e(dollars(p['estimated_usd']))}</td>"
            f"<td>{_e(dollars(p['actual_usd']))}</td>"
            f"<td>{ratio}</td><td>{_sec(p['estimated_seconds'])}</td><td>{_sec(p['actual_seconds'])}</td></tr>"
        )
    mem = report.get("plan_memory_gb")
    act = report.get("actual_peak_memory_gb")
    memrow = (
        (
            f"<p style='font-size:13px'>Student memory per device: planned {mem:.4f} GB"
            + (f", measured peak {act:.4f} GB (process RSS on CPU, allocator peak on GPU)" if act is not None else "")
            + "</p>"
        )
        if mem is not None
        else ""
    )
    return (
        "<table><tr><th>stage</th><th>estimate</th><th>actual</th><th>actual / estimate</th><th>est. time</th>"
        f"<th>actual time</th></tr>{rows}</table>{memrow}"
    )


def _sec(x) -> str:
    return "n/a" if x is None else f"{x:,.1f} s"


def _ts(v) -> float:
    if isinstance(v, dt.datetime):
        return v.replace(tzinfo=v.tzinfo or dt.UTC).timestamp()
    return dt.datetime.fromisoformat(str(v)).replace(tzinfo=dt.UTC).timestamp()


def _tile(label: str, value: str, sub: str = "", cls: str = "") -> str:
    return (
        f'<div class="tile"><div class="label">{_e(label)}</div><div class="value {cls}">{_e(value)}</div>'
        f'<div class="sub">{_e(sub)}</div></div>'
    )


SWEEP_COLORS = (
    "#2563eb",
    "#f59e0b",
    "#10b981",
    "#8b5cf6",
    "#ec4899",
    "#14b8a6",
    "#f97316",
    "#64748b",
    "#84cc16",
    "#06b6d4",
    "#a855f7",
    "#ef4444",
)


def sweep_panel_data(sweep: dict) -> dict:
    """What the sweep panel draws, from a sweep result (``campaign_orchestrator.sweep.Sweep.summary``)."""
    keep = (
        "study",
        "rungs",
        "trials_run",
        "trials_pruned",
        "pruned_at_first_rung",
        "trials_complete",
        "trials_stopped_by_cap",
        "best_trial",
        "best_params",
        "best_value",
        "default_value",
        "spent_usd",
        "cap_usd",
        "stopped_by_cap",
        "time_saved_seconds",
        "trial_seconds",
        "every_trial_to_the_end_seconds",
        "key",
    )
    trials = [
        {k: t[k] for k in ("trial", "root", "state", "params", "rungs", "usd")}
        for t in sweep["trials"]
        if t["state"] != "FAIL" or t["rungs"]
    ]
    return {k: sweep.get(k) for k in keep} | {"trials": trials}


def sweep_trial_costs(ledger, campaign: str, sweep_key: str) -> dict[str, float]:
    """Ledger spend per trial partition (``trial-NNN``) of one sweep, every run and rung."""
    rows = ledger.production_spend(campaign, "hparam_sweep", sweep_key)
    out: dict[str, float] = {}
    for r in rows:
        trial = str(r["production_id"]).split(":")[2]
        out[trial] = out.get(trial, 0.0) + float(r["usd"])
    return out


def chart_sweep(panel: dict, costs: dict[str, float]) -> str:
    """Eval loss against steps for every trial: pruned trials end in a cross, completed ones in a dot, the best
    is drawn thick; then the trials table with each trial's cost from the ledger."""
    trials = [t for t in panel["trials"] if t["rungs"]]
    if not trials:
        return _empty("no trial has finished a rung yet")
    vals = [float(r["value"]) for t in trials for r in t["rungs"].values() if math.isfinite(float(r["value"]))]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    ceiling = hi + 0.08 * ((hi - lo) or 1.0)  # diverged trials (loss inf) are drawn at the top edge
    p = _Plot(h=300)
    p.axes(
        0,
        max(panel["rungs"]),
        max(0.0, lo - 0.05 * ((hi - lo) or 1.0)),
        ceiling,
        lambda v: f"{v:g}",
        lambda v: f"{v:.2f}",
        "optimizer steps (rungs: " + ", ".join(str(r) for r in panel["rungs"]) + ")",
        "eval loss",
    )
    for r in panel["rungs"]:
        x = p.px(r)
        p.parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{p.t}" y2="{p.h - p.b}" stroke="#e5e7eb" stroke-dasharray="3 3"/>'
        )
    for _i, t in enumerate(sorted(trials, key=lambda t: t["trial"] == panel.get("best_trial"))):
        color = SWEEP_COLORS[t["trial"] % len(SWEEP_COLORS)]
        best = t["trial"] == panel.get("best_trial")
        pts = [
            (int(k), min(float(v["value"]), ceiling) if math.isfinite(float(v["value"])) else ceiling)
            for k, v in sorted(t["rungs"].items(), key=lambda kv: int(kv[0]))
        ]
        path = " ".join(f"{'M' if j == 0 else 'L'}{p.px(x):.1f},{p.py(y):.1f}" for j, (x, y) in enumerate(pts))
        cost = costs.get(trial_pk(t), t["usd"])
        tip = (
            f"trial {t['trial']} {t['state']} · "
            + ", ".join(f"{k.split('.')[-1]}={_fmt(v)}" for k, v in t["params"].items())
            + f" · {_e(dollars(cost))}"
        )
        p.parts.append(
            f'<path d="{path}" fill="none" stroke="{color}" stroke-width="{4 if best else 2}" '
            f'opacity="{1 if best or t["state"] != "PRUNED" else 0.75}"><title>{_e(tip)}</title></path>'
        )
        for x, y in pts[:-1]:
            p.parts.append(f'<circle cx="{p.px(x):.1f}" cy="{p.py(y):.1f}" r="3" fill="{color}"/>')
        x, y = pts[-1]
        cx, cy = p.px(x), p.py(y)
        if t["state"] == "PRUNED":
            p.parts.append(
                f'<path d="M{cx - 5:.1f},{cy - 5:.1f}L{cx + 5:.1f},{cy + 5:.1f}M{cx - 5:.1f},{cy + 5:.1f}'
                f'L{cx + 5:.1f},{cy - 5:.1f}" stroke="{color}" stroke-width="2.5"><title>{_e(tip)}</title></path>'
            )
        elif t["state"] == "STOPPED":
            p.parts.append(
                f'<rect x="{cx - 5:.1f}" y="{cy - 5:.1f}" width="10" height="10" fill="{color}">'
                f"<title>{_e(tip)}</title></rect>"
            )
        else:
            p.parts.append(
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{7 if best else 5}" fill="{color}" stroke="#111827" '
                f'stroke-width="{2 if best else 0}"><title>{_e(tip)}</title></circle>'
            )
        label = f"#{t['trial']}" + (" best" if best else "")
        p.parts.append(
            f'<text x="{cx + 8:.1f}" y="{cy + 4:.1f}" style="fill:{color};font-weight:600">{_e(label)}</text>'
        )
    legend = (
        '<p class="legend"><span>● completed</span><span>✕ pruned</span><span>■ stopped by the cap</span>'
        "<span>thick: the best trial (drives student_adapter)</span><span>top edge: diverged</span></p>"
    )
    rows = []
    for t in sorted(panel["trials"], key=lambda t: t["trial"]):
        last = max((int(k) for k in t["rungs"]), default=0)
        v = t["rungs"].get(str(last), {}).get("value") if last else None
        rows.append(
            f"<tr><td>#{t['trial']}{' (best)' if t['trial'] == panel.get('best_trial') else ''}</td>"
            f"<td>{_e(t['state'])}</td><td>{_e(', '.join(f'{k}={_fmt(x)}' for k, x in t['params'].items()))}</td>"
            f"<td>{last}</td><td>{'—' if v is None else _e(_fmt(v))}</td>"
            f"<td>{_e(dollars(costs.get(trial_pk(t), t['usd'])))}</td></tr>"
        )
    table = (
        "<table><tr><th>trial</th><th>state</th><th>parameters</th><th>steps</th><th>eval loss</th>"
        f"<th>cost (ledger)</th></tr>{''.join(rows)}</table>"
    )
    return (
        '<div style="max-width:900px">' + p.svg("sweep: eval loss against steps per trial") + "</div>" + legend + table
    )


def trial_pk(t: dict) -> str:
    return f"trial-{t['root']:03d}"


def _fmt(v) -> str:
    if isinstance(v, float):
        return "inf" if not math.isfinite(v) else f"{v:.4g}"
    return str(v)


def sweep_section(panel: dict | None, costs: dict[str, float]) -> str:
    if not panel:
        return ""
    cap = panel.get("cap_usd")
    spent = sum(costs.values()) if costs else panel.get("spent_usd") or 0.0
    saved, full = panel.get("time_saved_seconds") or 0.0, panel.get("every_trial_to_the_end_seconds") or 0.0
    tiles = [
        _tile(
            "sweep trials",
            f"{panel['trials_run']}",
            f"{panel['trials_pruned']} pruned "
            f"({panel['pruned_at_first_rung']} at the first rung), {panel['trials_complete']} to the end",
        ),
        _tile(
            "sweep spend",
            dollars(spent),
            "no cap" if cap is None else f"of a {dollars(cap)} cap ({spent / cap:.0%})",
            "warn" if cap is not None and spent > cap else "",
        ),
        _tile(
            "time saved",
            f"{saved:.0f} s",
            f"vs {full:.0f} s had every trial run to the end ({saved / full:.0%} less)" if full else "",
        ),
        _tile(
            "best eval loss",
            "n/a" if panel.get("best_value") is None else f"{panel['best_value']:.4f}",
            "campaign default " + ("n/a" if panel.get("default_value") is None else f"{panel['default_value']:.4f}"),
        ),
    ]
    note = f'<p class="warn">{_e(panel["stopped_by_cap"])}</p>' if panel.get("stopped_by_cap") else ""
    best = ", ".join(f"{k} = {_fmt(v)}" for k, v in (panel.get("best_params") or {}).items())
    return (
        f'<section class="card" id="sweep" style="margin-top:14px"><h2>Sweep · {_e(panel.get("study") or "")}</h2>'
        f'<section class="tiles">{"".join(tiles)}</section>{note}'
        f"<p>best configuration (trial #{_e(panel.get('best_trial'))}): <b>{_e(best)}</b></p>"
        f"{chart_sweep(panel, costs)}</section>"
    )


def render_dashboard(
    campaign: str, ledger, budget_usd: float | None = None, now: dt.datetime | None = None, sweep: dict | None = None
) -> str:
    """The dashboard HTML of ``campaign`` from a :class:`campaign_orchestrator.costs.ledger.Ledger`; ``sweep``: the
    latest sweep's panel data (``sweep_panel_data``), drawn as the sweep panel."""
    lines, runs, reports = ledger.lines(campaign), ledger.runs(campaign), ledger.reports(campaign)
    spent = float(sum(float(x["usd"]) for x in lines))
    latest = reports[-1]["report"] if reports else None
    unknown = sorted({u for r in reports for u in r["report"].get("unknown_costs") or []})
    # runs that stopped before a report (no evaluation) but produced something at an unknown price
    unknown = unknown or sorted(f"{a} {why}" for a, why in ledger.unknown(campaign).items())
    tiles = [
        _tile(
            "campaign spend",
            f"{dollars(spent)} + unknown" if unknown else dollars(spent),
            f"{len(runs)} run(s) in the ledger" + (f"; unpriced: {'; '.join(unknown)}" if unknown else ""),
            "warn" if unknown else "",
        )
    ]
    if latest:
        lcb = latest.get("usd_per_point_gained_lcb")
        lcb_text = (
            _usd(latest, "usd_per_point_gained_lcb")
            if lcb is not None or latest.get("unknown_costs")
            else "not meaningful"
        )
        ratio = latest.get("student_teacher_ratio")
        tiles += [
            _tile(
                "latest result cost",
                _usd(latest, "total_usd"),
                f"run {str(latest['run_id'])[:8]} · {latest.get('verdict')}",
                "warn" if latest.get("unknown_costs") else "",
            ),
            _tile(
                "$ / M teacher tokens",
                _usd(latest, "usd_per_million_teacher_tokens"),
                f"{latest['teacher_tokens']:,} tokens",
            ),
            _tile(
                "$ / 1k accepted examples",
                _usd(latest, "usd_per_1k_accepted_examples"),
                f"{latest['accepted_examples']:,} accepted",
            ),
            _tile(
                "$ / point gained",
                lcb_text,
                "at the gain's lower 95% bound" if lcb is not None else "lower bound of the gain ≤ 0",
                "" if lcb is not None else "warn",
            ),
            _tile(
                "candidate score",
                "n/a" if latest.get("candidate_score") is None else f"{latest['candidate_score']:.1%}",
                "base " + ("n/a" if latest.get("base_score") is None else f"{latest['base_score']:.1%}"),
            ),
            _tile(
                "student ÷ teacher",
                "n/a" if ratio is None else f"{ratio:.1%}",
                "teacher "
                + ("not scored" if latest.get("teacher_score") is None else f"{latest['teacher_score']:.1%}")
                + f" on {latest.get('primary_suite') or 'the primary suite'}",
            ),
        ]
    if budget_usd is not None:
        tiles.append(
            _tile(
                "budget used",
                f"{spent / budget_usd:.1%}",
                f"of {dollars(budget_usd)}",
                "warn" if spent >= 0.9 * budget_usd else "",
            )
        )
    by_run = {r["run_id"]: r["report"] for r in reports}
    run_rows = "".join(
        f"<tr><td>{_e(str(r['run_id'])[:8])}</td><td>{_e(str(r['started_at'])[:19])}</td>"
        f"<td>{_e(dollars(r['usd']) + (' + unknown' if r.get('unknown') else ''))}</td>"
        f"<td>{_e(dollars(r['interrupted_usd']))}</td>"
        f"<td>{_e((by_run.get(r['run_id']) or {}).get('verdict') or '—')}</td>"
        f"<td>{_score(by_run.get(r['run_id']))}</td><td>{_e(_per_point(by_run.get(r['run_id'])))}</td></tr>"
        for r in reversed(runs)
    )
    data = {
        "campaign": campaign,
        "spent_usd": spent,
        "budget_usd": budget_usd,
        "runs": runs,
        "reports": [r["report"] for r in reports],
        "sweep": sweep,
    }
    generated = (now or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%d %H:%M UTC")
    spend_charts = chart_spend_over_time(lines, budget_usd) + chart_budget(spent, budget_usd)
    sweep_html = sweep_section(sweep, sweep_trial_costs(ledger, campaign, sweep["key"]) if sweep else {})
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Cost dashboard · {_e(campaign)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body><header><h1>Cost dashboard · campaign <span id="campaign">{_e(campaign)}</span></h1>
<p>From the cost ledger ({_e(ledger.path.name)}) · generated {generated} · hover a mark for its numbers</p></header>
<main><section class="tiles">{"".join(tiles)}</section>
<section class="grid">
<div class="card"><h2>Spend over time and budget</h2>{spend_charts}</div>
<div class="card"><h2>Spend per run, by stage</h2>{chart_runs_by_stage(runs)}</div>
<div class="card"><h2>Cost of each result against its score</h2>{chart_cost_vs_score(reports)}</div>
<div class="card"><h2>Planner estimate against actual (latest result)</h2>{chart_plan_vs_actual(latest)}</div>
</section>
<section class="card" style="margin-top:14px"><h2>Runs</h2><table>
<tr><th>run</th><th>first record (UTC)</th><th>spent in run</th><th>budget-stopped</th><th>verdict</th><th>score</th>
<th>$ / point (lower bound)</th></tr>
{run_rows}</table></section>{sweep_html}</main>
<script type="application/json" id="dashboard-data">{html.escape(json.dumps(data, default=str), quote=False)}</script>
</body></html>"""


def _score(r: dict | None) -> str:
    return "—" if not r or r.get("candidate_score") is None else f"{r['candidate_score']:.1%}"


def _per_point(r: dict | None) -> str:
    if not r:
        return "—"
    return dollars(r["usd_per_point_gained_lcb"]) if r.get("usd_per_point_gained_lcb") is not None else "not meaningful"


def write_dashboard(
    path: str | Path, campaign: str, ledger, budget_usd: float | None = None, sweep: dict | None = None
) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(render_dashboard(campaign, ledger, budget_usd, sweep=sweep), encoding="utf-8")
    os.replace(tmp, p)
    return p


# =========================================================================== the team dashboard
# One page across every campaign in the ledger, for a team lead: spend over calendar time (by day and by ISO week)
# by campaign and stage, cost and scores per run (every suite), GPU- and host-hours by hardware, budget burn, the
# planner's estimates against actuals with misses flagged, and the runs that reused everything (spent nothing).

TEAM_DIR = "dashboards"  # under the artifact root: what `campaign dashboard --serve` serves
MISS_LOW, MISS_HIGH = 0.5, 2.0  # actual / estimate outside this band is a planner miss (flagged)
CAMPAIGN_COLORS = SWEEP_COLORS


def _day(v) -> str:
    return dt.datetime.fromtimestamp(_ts(v), dt.UTC).strftime("%Y-%m-%d")


def _week(v) -> str:
    y, w, _ = dt.datetime.fromtimestamp(_ts(v), dt.UTC).isocalendar()
    return f"{y}-W{w:02d}"


def _miss(ratio: float | None) -> bool:
    return ratio is not None and not MISS_LOW <= ratio <= MISS_HIGH


def _judged(
    outcomes: dict, campaign: str, run_id: str, stage: str, ratio: float | None, reported_from: str | None = None
) -> dict:
    """A plan row's verdict: a miss only where this run produced the stage (every later run that reuses the output
    repeats the producing run's actuals: one planner miss is counted once); a reused stage says from which run
    (the ledger's materializations; else what the run's report recorded); a stage the run did not materialize is
    neither."""
    o = outcomes.get((campaign, run_id, stage))
    produced = o is not None and o["produced"]
    src = None if produced else (o or {}).get("reused_from") or reported_from
    return {
        "produced_here": produced,
        "reused": not produced and (o is not None or src is not None),
        "reused_from_run": src,
        "miss": produced and _miss(ratio),
    }


def team_data(ledger) -> dict:
    """Every series the team dashboard draws, from the ledger's rows (``cost_lines``, ``materializations``,
    ``cost_reports``)::

        spend_by_day / spend_by_week   [{period, campaign, stage, usd}]   (stage: the asset that spent)
        campaigns                      [{campaign, usd, runs, budget_usd, budget_used}]
        hardware                       [{campaign, resource, unit, quantity, usd}]  (gpu-hour / host-hour lines)
        runs                           [{campaign, run_id, started_at, usd, verdict, total_usd, scores,
                                         base_scores, reused_everything}]
        plan                           [{campaign, run_id, stage, estimated_usd, actual_usd, usd_ratio, miss,
                                         produced_here, reused, reused_from_run, ...}]  (miss: only if produced_here)
    """
    lines = ledger.lines()
    by_day: dict[tuple, float] = {}
    by_week: dict[tuple, float] = {}
    hw: dict[tuple, list[float]] = {}
    for x in lines:
        usd_ = float(x["usd"])
        for acc, period in ((by_day, _day(x["recorded_at"])), (by_week, _week(x["recorded_at"]))):
            k = (period, x["campaign"], x["asset"])
            acc[k] = acc.get(k, 0.0) + usd_
        if x["unit"] in ("gpu-hour", "host-hour"):
            h = hw.setdefault((x["campaign"], x["resource"], x["unit"]), [0.0, 0.0])
            h[0] += float(x["quantity"])
            h[1] += usd_
    reused_all = ledger.runs_reusing_everything()
    outcomes = ledger.stage_outcomes()
    runs, plan, campaigns = [], [], []
    for name in ledger.campaigns():
        reports = {r["run_id"]: r["report"] for r in ledger.reports(name)}
        latest = list(reports.values())[-1] if reports else {}
        spent = ledger.spent(name)
        budget = latest.get("budget_usd")
        name_runs = ledger.runs(name)
        campaigns.append(
            {
                "campaign": name,
                "usd": spent,
                "runs": len(name_runs),
                "budget_usd": budget,
                "budget_used": spent / budget if budget else None,
            }
        )
        for r in name_runs:
            rep = reports.get(r["run_id"]) or {}
            runs.append(
                {
                    "campaign": name,
                    "run_id": r["run_id"],
                    "started_at": str(r["started_at"]),
                    "day": _day(r["started_at"]),
                    "usd": float(r["usd"]),
                    "verdict": rep.get("verdict"),
                    "total_usd": rep.get("total_usd"),
                    "primary_suite": rep.get("primary_suite"),
                    "scores": rep.get("suite_scores")
                    or (
                        {rep["primary_suite"]: rep["candidate_score"]} if rep.get("candidate_score") is not None else {}
                    ),
                    "base_scores": rep.get("base_suite_scores") or {},
                    "gpu_hours": rep.get("gpu_hours"),
                    "host_hours": rep.get("host_hours"),
                    "reused_everything": r["run_id"] in reused_all and float(r["usd"]) == 0.0,
                }
            )
        for run_id, rep in reports.items():
            for p in rep.get("plan_vs_actual") or []:
                if p.get("estimated_usd") is None:
                    continue
                plan.append(
                    {
                        "campaign": name,
                        "run_id": run_id,
                        **{
                            k: p.get(k)
                            for k in ("stage", "estimated_usd", "actual_usd", "usd_ratio", "estimated_seconds")
                        },
                        "actual_seconds": p.get("actual_seconds"),
                        **_judged(outcomes, name, run_id, p["stage"], p.get("usd_ratio"), p.get("reused_from_run")),
                    }
                )
            mem, act = rep.get("plan_memory_gb"), rep.get("actual_peak_memory_gb")
            if mem and act is not None:  # the trainer's peak: a planner miss of the run that trained
                plan.append(
                    {
                        "campaign": name,
                        "run_id": run_id,
                        "stage": "student memory (GB)",
                        "estimated_usd": None,
                        "actual_usd": None,
                        "usd_ratio": None,
                        "estimated_gb": mem,
                        "actual_gb": act,
                        "memory_ratio": act / mem,
                        **_judged(outcomes, name, run_id, "student_adapter", act / mem),
                    }
                )

    def rows(acc):
        return [
            {"period": p, "campaign": c, "stage": s, "usd": v}  # noqa: E731
            for (p, c, s), v in sorted(acc.items())
        ]

    return {
        "spend_by_day": rows(by_day),
        "spend_by_week": rows(by_week),
        "campaigns": campaigns,
        "hardware": [
            {"campaign": c, "resource": r, "unit": u, "quantity": q, "usd": v}
            for (c, r, u), (q, v) in sorted(hw.items())
        ],
        "runs": sorted(runs, key=lambda r: r["started_at"]),
        "plan": plan,
    }


def chart_spend_by_period(rows: list[dict], campaigns: list[str], label: str) -> str:
    """Stacked bars: spend per calendar period, one colour per campaign."""
    periods = sorted({r["period"] for r in rows})
    if not periods:
        return _empty("no spend recorded yet")
    color = {c: CAMPAIGN_COLORS[i % len(CAMPAIGN_COLORS)] for i, c in enumerate(campaigns)}
    totals = {p: sum(r["usd"] for r in rows if r["period"] == p) for p in periods}
    w, h, left, bottom, top = 560, 260, 64, 34, 12
    ticks = _ticks(0, max(totals.values()) or 1.0)
    scale = (h - bottom - top) / ticks[-1]
    slot = (w - left - 20) / len(periods)
    parts = []
    for t in ticks:
        y = h - bottom - t * scale
        parts.append(
            f'<line x1="{left}" x2="{w - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eef0f4"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(dollars(t))}</text>'
        )
    for i, p in enumerate(periods):
        x, y = left + i * slot + slot * 0.15, float(h - bottom)
        for c in campaigns:
            v = sum(r["usd"] for r in rows if r["period"] == p and r["campaign"] == c)
            if v <= 0:
                continue
            stages = ", ".join(
                f"{r['stage']} {dollars(r['usd'])}" for r in rows if r["period"] == p and r["campaign"] == c
            )
            parts.append(
                f'<rect class="spend" data-period="{_e(p)}" data-campaign="{_e(c)}" x="{x:.1f}" '
                f'y="{y - v * scale:.1f}" width="{slot * 0.7:.1f}" height="{max(v * scale, 1):.1f}" '
                f'fill="{color[c]}"><title>{_e(p)} · {_e(c)}: {_e(dollars(v))} ({_e(stages)})</title></rect>'
            )
            y -= v * scale
        parts.append(
            f'<text x="{x + slot * 0.35:.1f}" y="{h - bottom + 16}" text-anchor="middle">{_e(p)}</text>'
            f'<text x="{x + slot * 0.35:.1f}" y="{y - 4:.1f}" text-anchor="middle">'
            f"{_e(dollars(totals[p]))}</text>"
        )
    legend = "".join(f'<span><i style="background:{color[c]}"></i>{_e(c)}</span>' for c in campaigns)
    return (
        f'<div class="legend">{legend}</div><svg viewBox="0 0 {w} {h}" width="100%" role="img" '
        f'aria-label="{_e(label)}">{"".join(parts)}</svg>'
    )


def chart_team_cost_vs_score(runs: list[dict], campaigns: list[str]) -> str:
    pts = [r for r in runs if r.get("total_usd") is not None and r["scores"]]
    if not pts:
        return _empty("no evaluated result yet")
    color = {c: CAMPAIGN_COLORS[i % len(CAMPAIGN_COLORS)] for i, c in enumerate(campaigns)}
    p = _Plot()
    p.axes(
        0,
        max(r["total_usd"] for r in pts) * 1.1 or 1e-6,
        0,
        100,
        lambda v: dollars(v),
        lambda v: f"{v:g}%",
        "cost of the result",
        "score (every suite)",
    )
    for r in pts:
        for suite, score in r["scores"].items():
            primary = suite == r.get("primary_suite")
            p.parts.append(
                f'<circle cx="{p.px(r["total_usd"]):.1f}" cy="{p.py(score * 100):.1f}" r="{6 if primary else 4}" '
                f'fill="{color[r["campaign"]]}" fill-opacity="{0.9 if primary else 0.45}"><title>'
                f"{_e(r['campaign'])} run {_e(r['run_id'][:8])} · {_e(suite)} {score:.1%} · "
                f"{_e(dollars(r['total_usd']))} · {_e(r.get('verdict'))}</title></circle>"
            )
    return p.svg("cost of each result against its scores, every campaign")


def _table(head: list[str], rows: list[list[str]], cls: str = "") -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><tr>{th}</tr>{body}</table>'


def render_team_dashboard(ledger, now: dt.datetime | None = None, links: dict[str, str] | None = None) -> str:
    """The team's cost dashboard (every campaign in the ledger) as one self-contained HTML page; ``links``:
    campaign -> the URL of its own dashboard."""
    d = team_data(ledger)
    names = [c["campaign"] for c in d["campaigns"]]
    total = sum(c["usd"] for c in d["campaigns"])
    days = sorted({r["period"] for r in d["spend_by_day"]})
    gpu = sum(h["quantity"] for h in d["hardware"] if h["unit"] == "gpu-hour")
    host = sum(h["quantity"] for h in d["hardware"] if h["unit"] == "host-hour")
    misses = [p for p in d["plan"] if p["miss"]]
    reused = [r for r in d["runs"] if r["reused_everything"]]
    tiles = [
        _tile("team spend", dollars(total), f"{len(names)} campaign(s), {len(d['runs'])} run(s)"),
        _tile("days with spend", str(len(days)), f"{days[0]} to {days[-1]}" if days else ""),
        _tile("GPU-hours", f"{gpu:,.2f}", f"host-hours {host:,.2f}"),
        _tile(
            "planner misses",
            str(len(misses)),
            f"a produced stage's actual outside {MISS_LOW:g}×–{MISS_HIGH:g}× of its estimate; reused ones never count",
            "warn" if misses else "",
        ),
        _tile("runs that reused everything", str(len(reused)), "spent nothing"),
    ]
    link = lambda c: f'<a href="{_e(links[c])}">{_e(c)}</a>' if links and c in links else _e(c)  # noqa: E731
    stage_rows = {}
    for r in d["spend_by_day"]:
        stage_rows[(r["campaign"], r["stage"])] = stage_rows.get((r["campaign"], r["stage"]), 0.0) + r["usd"]
    by_stage = _table(
        ["campaign", "stage", "spent"], [[link(c), _e(s), _e(dollars(v))] for (c, s), v in sorted(stage_rows.items())]
    )
    weeks = _table(
        ["week", "campaign", "stage", "spent"],
        [[_e(r["period"]), _e(r["campaign"]), _e(r["stage"]), _e(dollars(r["usd"]))] for r in d["spend_by_week"]],
    )
    budget = _table(
        ["campaign", "spent", "budget", "used", ""],
        [
            [
                link(c["campaign"]),
                _e(dollars(c["usd"])),
                _e(dollars(c["budget_usd"]) if c["budget_usd"] else "none"),
                _e("n/a" if c["budget_used"] is None else f"{c['budget_used']:.1%}"),
                (
                    '<svg width="120" height="10" aria-label="budget burn"><rect width="120" height="10" '
                    f'fill="#eef0f4"/><rect width="{min(c["budget_used"], 1) * 120:.1f}" height="10" '
                    f'fill="{COLORS["budget"] if c["budget_used"] >= 0.9 else COLORS["line"]}"/></svg>'
                )
                if c["budget_used"]
                else "",
            ]
            for c in d["campaigns"]
        ],
    )
    hardware = _table(
        ["campaign", "hardware", "hours", "spent"],
        [
            [_e(h["campaign"]), _e(h["resource"]), _e(f"{h['quantity']:,.4g} {h['unit']}s"), _e(dollars(h["usd"]))]
            for h in d["hardware"]
        ],
    )
    plan_rows = []
    for p in d["plan"]:
        if "memory_ratio" in p:
            est, act, ratio = f"{p['estimated_gb']:.2f} GB", f"{p['actual_gb']:.2f} GB", p["memory_ratio"]
        else:
            est, act, ratio = dollars(p["estimated_usd"]), dollars(p["actual_usd"]), p["usd_ratio"]
        src = p.get("reused_from_run")
        flag = "reused" + (f" (from run {_e(src[:8])})" if src else "") if p.get("reused") else ""
        flag = '<span class="warn">MISS</span>' if p["miss"] else flag
        plan_rows.append(
            [
                _e(p["campaign"]),
                _e(p["run_id"][:8]),
                _e(p["stage"]),
                _e(est),
                _e(act),
                _e("n/a" if ratio is None else f"{ratio:.2f}×"),
                flag,
            ]
        )
    plan = _table(["campaign", "run", "stage", "estimate", "actual", "actual / estimate", ""], plan_rows)
    run_rows = [
        [
            link(r["campaign"]),
            _e(r["run_id"][:8]),
            _e(r["started_at"][:16]),
            _e(dollars(r["usd"])),
            _e(dollars(r["total_usd"])),
            _e(r["verdict"] or "—"),
            _e(", ".join(f"{s} {v:.1%}" for s, v in r["scores"].items()) or "—"),
            '<span class="reused">reused everything</span>' if r["reused_everything"] else "",
        ]
        for r in reversed(d["runs"])
    ]
    runs = _table(
        ["campaign", "run", "started (UTC)", "spent in run", "cost of result", "verdict", "scores (every suite)", ""],
        run_rows,
    )
    generated = (now or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Team cost dashboard</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}
.reused{{color:#047857;font-weight:600}}</style></head>
<body><header><h1>Team cost dashboard · every campaign</h1>
<p>From the cost ledger ({_e(ledger.path.name)}) · generated {generated} · hover a mark for its numbers</p></header>
<main><section class="tiles">{"".join(tiles)}</section>
<section class="grid">
<div class="card"><h2>Spend per day, by campaign</h2>
{chart_spend_by_period(d["spend_by_day"], names, "spend per day")}</div>
<div class="card"><h2>Cost of each result against its scores</h2>{chart_team_cost_vs_score(d["runs"], names)}</div>
<div class="card"><h2>Spend by campaign and stage</h2>{by_stage}</div>
<div class="card"><h2>Spend per week</h2>{weeks}</div>
<div class="card"><h2>Budget burn</h2>{budget}</div>
<div class="card"><h2>GPU-hours and hardware</h2>{hardware}</div>
</section>
<section class="card" style="margin-top:14px"><h2>Planner estimate against actual</h2>{plan}</section>
<section class="card" style="margin-top:14px"><h2>Runs</h2>{runs}</section></main>
<script type="application/json" id="team-data">{html.escape(json.dumps(d, default=str), quote=False)}</script>
</body></html>"""


def write_team_dashboard(root: str | Path, ledger, campaign_pages: dict[str, Path] | None = None) -> Path:
    """Write ``<root>/dashboards/index.html`` (the team's page) and copy each campaign's own page beside it as
    ``<campaign>.html``, so that one folder served over HTTP (``campaign dashboard --serve``) holds them all."""
    out = Path(root) / TEAM_DIR
    out.mkdir(parents=True, exist_ok=True)
    links = {}
    for name, page in (campaign_pages or {}).items():
        if Path(page).exists():
            _atomic(out / f"{name}.html", Path(page).read_text(encoding="utf-8"))
            links[name] = f"{name}.html"
    for p in out.glob("*.html"):
        if p.name != "index.html":
            links.setdefault(p.stem, p.name)
    return _atomic(out / "index.html", render_team_dashboard(ledger, links=links))


def _atomic(path: Path, text: str) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
