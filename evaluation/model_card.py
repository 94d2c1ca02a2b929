"""The promoted student's model card: a ``README.md`` in the Hugging Face format (YAML front matter, then
Markdown) written into the promoted adapter directory. Plain rendering from dicts the ``promoted_model`` asset
gathers (the stage manifests); the candidate-versus-teacher intervals are computed here from the evaluation items.

Sections: the base model (and its own card), the data lineage (prompts, teacher, filters, replay,
decontamination), the recipe (LoRA, training, the kept checkpoint), the gate's scores with intervals against the
base and the teacher, and the cost of the result."""

from __future__ import annotations

import json
import math

from evaluation.stats import paired_difference, score_ci
from evaluation.suite import read_item_results


def teacher_intervals(items_path: str, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0) -> dict:
    """suite -> {"teacher": interval of its score, "delta": interval of candidate - teacher on the shared items}."""
    res = read_item_results(items_path)
    out = {}
    for suite, teach in (res.get("teacher") or {}).items():
        cand = {r.item_id: r.score for r in res.get("candidate", {}).get(suite, []) if r.score is not None}
        pairs = [(cand[r.item_id], r.score) for r in teach if r.score is not None and r.item_id in cand]
        if not pairs:
            continue
        c, t = [p[0] for p in pairs], [p[1] for p in pairs]
        out[suite] = {
            "teacher": score_ci(t, confidence).as_dict(),
            "delta": paired_difference(c, t, confidence, resamples=resamples, seed=seed).as_dict(),
        }
    return out


def _pct(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def _iv(d: dict | None, pts: bool = False) -> str:
    if not d or d.get("estimate") is None:
        return "–"
    if pts:
        return f"{100 * d['estimate']:+.1f} pts [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"
    return f"{_pct(d['estimate'])} [{_pct(d['lo'])}, {_pct(d['hi'])}]"


def render_card(info: dict) -> str:
    """The ``README.md`` text. ``info`` keys: campaign, description, candidate_key, base_model, base_model_card,
    lineage, recipe, gate (verdict, method, suites), teacher_intervals, cost (stages, total_usd)."""
    base = info["base_model"]
    front = {
        "base_model": base,
        "library_name": "peft",
        "pipeline_tag": "text-generation",
        "tags": ["lora", "distillation", "campaign-orchestrator", info["campaign"]],
    }
    card = info.get("base_model_card") or {}
    lic = card.get("license") or (card.get("source") or {}).get("license")  # a converted model's card: in source
    if lic:
        front["license"] = str(lic).lower()  # the Hub's identifiers are lowercase (apache-2.0)
    lines = [
        "---",
        *(f"{k}: {json.dumps(v)}" for k, v in front.items()),
        "---",
        "",
        f"# {info['campaign']}: LoRA student of `{base}`",
        "",
        info.get("description") or "",
        "",
        f"Candidate `{info['candidate_key']}`, promoted on a **{info['gate']['verdict']}** from the campaign's gate.",
        "",
        "## Base model",
        "",
        f"`{base}` (the adapter applies to it with PEFT).",
    ]
    card = info.get("base_model_card")
    if card:
        lines += ["", "Its card:", "", "```json", json.dumps(card, indent=2, default=str), "```"]
    lin = info["lineage"]
    lines += [
        "",
        "## Data lineage",
        "",
        f"- **Prompts**: `{lin['prompts']['source']}`: {lin['prompts'].get('train', '?')} for training, "
        f"{lin['prompts'].get('heldout', '?')} held out.",
        f"- **Teacher**: {lin['teacher']['backend']} `{lin['teacher']['model']}`"
        + (f" at {lin['teacher']['base_url']}" if lin["teacher"].get("base_url") else "")
        + (f", {lin['teacher']['generations']} generations" if lin["teacher"].get("generations") else "")
        + ".",
        f"- **Filters**: {json.dumps(lin.get('filters', {}))}: {lin.get('rows', '?')} training examples kept.",
    ]
    rp = lin.get("replay")
    if rp:
        lines.append(
            f"- **Replay**: {rp['rows']} examples ({rp.get('share_actual', 0):.0%} of the mix), prompts from "
            f"`{rp['source']}` answered by the {rp['answered_by']} ({rp.get('generated', 0)} generated, "
            f"{rp.get('cache_hits', 0)} from the cache)."
        )
    else:
        lines.append("- **Replay**: none.")
    dec = lin.get("decontamination")
    if dec:
        lines.append(
            f"- **Decontamination** against the gate suites: {dec['contaminated_rows']} of "
            f"{dec['training_rows']} rows overlapped ({dec['ngram']}-grams, action {dec['action']})."
        )
    r = info["recipe"]
    lines += [
        "",
        "## Recipe",
        "",
        f"- LoRA r={r['lora']['r']}, alpha={r['lora']['alpha']}, targets {r['lora']['target_modules']}.",
        f"- {r['steps']} optimizer steps, learning rate {r['learning_rate']:g}, effective batch "
        f"{r['effective_batch']} rows of up to {r['max_seq_len']} tokens, loss {r['loss']}.",
    ]
    if r.get("selection"):
        lines.append(f"- Kept checkpoint: {r['selection']['reason']}.")
    g = info["gate"]
    ti = info.get("teacher_intervals") or {}
    lines += [
        "",
        "## Evaluation (the gate)",
        "",
        f"Verdict **{g['verdict']}**; intervals: {g.get('method', '')}.",
        "",
        "| suite | n | student | base | student − base | teacher | student − teacher |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in g["suites"]:
        o = s["overall"]
        t = ti.get(s["suite"], {})
        lines.append(
            f"| {s['suite']} | {o['n']} | {_iv(o['candidate'])} | {_iv(o['base'])} | {_iv(o['delta'], True)} "
            f"| {_iv(t.get('teacher'))} | {_iv(t.get('delta'), True)} |"
        )
    c = info["cost"]
    lines += [
        "",
        "## Cost of the result",
        "",
        "| stage | USD |",
        "|---|---:|",
        *(f"| {k} | {v:.6f} |" for k, v in c["stages"].items()),
        f"| **total** | **{c['total_usd']:.6f}** |",
        "",
    ]
    return "\n".join(lines)
