"""The promoted student's model card: a ``README.md`` in the Hugging Face format (YAML front matter, then
Markdown) written into the promoted adapter directory. Plain rendering from dicts the ``promoted_model`` asset
gathers (the stage manifests); the candidate-versus-teacher intervals are computed here from the evaluation items.

Sections: the base model (and its own card), the data lineage (prompts, teacher, filters, replay,
decontamination), the recipe (LoRA, training, the kept checkpoint), the gate's scores with intervals against the
base and the teacher, and the cost of the result."""

from __future__ import annotations

import json
import math
import re

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


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


def model_index(info: dict) -> list[dict]:
    """The gate's suites as the hub's ``model-index``: per suite, the student's score with its interval, the
    base's, and student − base (the gate's paired interval); the teacher's where it was scored. Metric types are
    the suite's scorer (``exact_match``) with a suffix (``_ci95_low``, ``_base``, ``_delta_vs_base``); values
    are fractions, as the gate computes them; an undefined bound is left out."""
    g, ti, suites = info["gate"], info.get("teacher_intervals") or {}, info.get("suites") or {}
    conf = round(100 * float((g.get("statistics") or {}).get("confidence") or 0.95))
    results = []
    for s in g["suites"]:
        o, meta, t = s["overall"], suites.get(s["suite"]) or {}, ti.get(s["suite"]) or {}
        scorer = meta.get("scorer") or "score"
        metrics = []
        for who, iv in (
            ("", o.get("candidate")),
            ("_base", o.get("base")),
            ("_delta_vs_base", o.get("delta")),
            ("_teacher", t.get("teacher")),
            ("_delta_vs_teacher", t.get("delta")),
        ):
            iv = iv or {}
            for part, key in (("", "estimate"), (f"_ci{conf}_low", "lo"), (f"_ci{conf}_high", "hi")):
                v = _num(iv.get(key))
                if v is not None:
                    metrics.append({"type": f"{scorer}{who}{part}", "value": v, "name": _metric_name(who, part, conf)})
        source = str(meta.get("source") or "")
        dataset = {"name": s["suite"], "type": source or s["suite"]}
        if source == "heldout":
            dataset |= {"type": f"{info['campaign']}-heldout", "split": "heldout"}
        task = f"gate suite {s['suite']} ({s.get('tier', 'blocking')}, {o['n']} paired items, {s['verdict']})"
        results.append({"task": {"type": "text-generation", "name": task}, "dataset": dataset, "metrics": metrics})
    return [{"name": f"{info['campaign']}-{info['candidate_key']}", "results": results}]


def _metric_name(who: str, part: str, conf: int) -> str:
    model = {
        "": "student",
        "_base": "base",
        "_delta_vs_base": "student − base (paired)",
        "_teacher": "teacher",
        "_delta_vs_teacher": "student − teacher (paired)",
    }[who]
    return model + ("" if not part else f", {conf}% interval {'low' if part.endswith('low') else 'high'}")


def front_matter(info: dict) -> dict:
    """The hub's card metadata: ``base_model`` (a hub id, only where one is known), the base's license, library,
    datasets, tags and ``model-index``."""
    card = info.get("base_model_card") or {}
    fm: dict = {}
    hub = info.get("base_model_hub_id")
    if hub:
        fm |= {"base_model": hub, "base_model_relation": "adapter"}
    lic = card.get("license") or (card.get("source") or {}).get("license")  # a converted model's card: in source
    if lic:
        fm["license"] = str(lic).lower()  # the Hub's identifiers are lowercase (apache-2.0)
    fm |= {"library_name": "peft", "pipeline_tag": "text-generation"}
    names = list(dict.fromkeys(dataset_name(x) for x in info.get("datasets") or []))
    if names:
        fm["datasets"] = names
    fm["tags"] = ["lora", "peft", "distillation", "campaign-orchestrator", info["campaign"]]
    fm["model-index"] = model_index(info)
    return fm


def code_version() -> str:
    """This code's version: the package's, and the git commit when it runs from a checkout (``+ changes`` when
    the tracked files differ from it)."""
    import subprocess
    from importlib import metadata
    from pathlib import Path

    try:
        out = f"campaign-orchestrator {metadata.version('campaign-orchestrator')}"
    except metadata.PackageNotFoundError:
        out = "campaign-orchestrator (not installed)"
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "--short=12", "HEAD")
    if sha:
        out += f", commit {sha}" + (" + changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    return out


def spec_facts(spec, base_card: dict | None) -> dict:
    """What the card takes from the campaign spec (a :class:`campaigns.spec.CampaignSpec`): the base's hub id where
    one is known, each suite's scorer and source, and the datasets trained on (the prompts, the replay prompts)."""
    from campaign_orchestrator import models

    d = spec.data
    return {
        "base_model_hub_id": models.hub_id(spec.student.base_model, spec.project_dir, base_card),
        "suites": {
            s.name: {"scorer": s.scorer if s.kind == "items" else None, "kind": s.kind, "source": s.source}
            for s in spec.evaluation.suites
        },
        "datasets": [d.source] + ([d.replay.source] if d.replay else []),
    }


def dataset_name(source: str) -> str:
    """A data source as the hub's ``datasets`` names one (a name, no folders or globs): the file's stem, or for a
    glob or folder the folder's name (``campaigns/data/demo/*.jsonl`` -> ``demo``); the body names the path."""
    from pathlib import PurePosixPath

    p = PurePosixPath(source)
    while p.name and any(c in p.name for c in "*?[") or p.name in ("", "."):
        if p.parent == p:
            break
        p = p.parent
    return re.sub(r"[^\w.-]+", "-", p.stem if p.suffix else p.name).strip("-.") or "data"


def render_card(info: dict) -> str:
    """The ``README.md`` text. ``info`` keys: campaign, description, candidate_key, base_model (the campaign's
    reference), base_model_hub_id, base_model_card, suites (name -> scorer, kind, source), datasets, lineage,
    recipe, gate (verdict, method, statistics, suites), teacher_intervals, cost (stages, total_usd), promotion
    (promoted_at, run_id), code_version (default: :func:`code_version`). Paths in it must already be portable
    (evaluation/promotion.py)."""
    import yaml

    base, hub = info["base_model"], info.get("base_model_hub_id")
    promo = info.get("promotion") or {}
    fm = yaml.safe_dump(front_matter(info), sort_keys=False, allow_unicode=True, width=1000)
    lines = [
        "---",
        fm.rstrip("\n"),
        "---",
        "",
        f"# {info['campaign']}: LoRA student of `{hub or base}`",
        "",
        info.get("description") or "",
        "",
        f"Candidate `{info['candidate_key']}`, promoted on a **{info['gate']['verdict']}** from the campaign's gate.",
        "",
        f"- **Promoted**: {promo.get('promoted_at') or '?'} (UTC), Dagster run `{promo.get('run_id') or '?'}`.",
        f"- **Code**: {info.get('code_version') or code_version()}.",
        f"- **Cost of the result**: ${info['cost']['total_usd']:.6f} (per stage below).",
        "",
        "## Base model",
        "",
    ]
    if hub and hub != base:
        lines.append(
            f"`{hub}` on the Hugging Face hub, as the campaign's `{base}` provides it (its card below says how: a "
            "converted model holds the values of the file it was converted from, e.g. a quantized GGUF, not the "
            "original weights). The adapter applies to that model with PEFT."
        )
    elif hub:
        lines.append(f"`{hub}` on the Hugging Face hub. The adapter applies to it with PEFT.")
    else:
        lines.append(f"`{base}`: a local model (no hub id). The adapter applies to it with PEFT.")
    lines += [
        "",
        "Load it the way the project does: the base from its own folder, then this adapter on top.",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"base = AutoModelForCausalLM.from_pretrained(BASE_DIR)  # {hub or base}",
        "model = PeftModel.from_pretrained(base, ADAPTER_DIR)  # this folder",
        "tokenizer = AutoTokenizer.from_pretrained(ADAPTER_DIR)  # the base's tokenizer, copied here",
        "```",
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
        *(
            [_teacher_line("Teacher", lin["teacher"])]
            if not lin.get("teachers")
            else [
                _teacher_line(f"Teacher `{t['name']}` ({', '.join(t['categories'] or ['the other categories'])})", t)
                for t in lin["teachers"]
            ]
        ),
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


def _teacher_line(label: str, t: dict) -> str:
    """A teacher in the data lineage: backend, model, endpoint, generations (several teachers: one line each)."""
    return (
        f"- **{label}**: {t['backend']} `{t['model']}`"
        + (f" at {t['base_url']}" if t.get("base_url") else "")
        + (f", {t['generations']} generations" if t.get("generations") else "")
        + "."
    )
