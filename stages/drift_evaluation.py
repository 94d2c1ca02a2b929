"""drift_evaluation: the promoted model re-scored on the freshest held-out data.

Run by the campaign's drift schedule (``<campaign>_drift``, the Dagster asset), never by the campaign job. It scores the
promoted model through the campaign's evaluation backend (locally, or through the endpoint after
checking it serves this adapter), is priced like evaluation and checked against the campaign's
budget (ledger asset ``drift_evaluation``), and compares the fresh scores with the promotion-time
ones on an unpaired interval (``evaluation/drift.py``). Its metadata carries the verdict (DRIFTED /
STABLE / INCONCLUSIVE) and the reasons; the
``<campaign>_drift_retrain`` sensor turns a DRIFTED verdict into a retraining run.

The items are the held-out rows (the campaign's hash rule) of prompts the promoted model never
saw: every ``prompts`` stage committed before its ``promoted_at`` is what it may have seen. Too
few of them (under the gate's ``min_items``) are topped up with its own promotion-time held-out
items, newest file first; an item it may have trained on is never used. Which files and how many
fresh items were used is in the manifest, ``drift.json`` and the metadata (``item_selection``).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections import Counter
from pathlib import Path

from campaigns.spec import CampaignSpec
from stages.common import stage_key
from stages.errors import StageError
from stages.outcome import Outcome
from stages.storage import Store

STAGE = "drift_evaluation"


def max_drop(spec: CampaignSpec) -> float:
    d = spec.automation.drift.max_drop
    return spec.evaluation.gate.max_regression_vs_base if d is None else d


def source_cache_dir(storage: Store, spec: CampaignSpec):
    """Where an ``s3://`` prompt source is mirrored (content-addressed) under the artifact root."""
    return storage.root_path() / "_sources" / spec.name


def promotion_data(storage: Store, spec: CampaignSpec, promoted_at: str | None):
    """What a model promoted at ``promoted_at`` may have seen: every complete ``prompts`` stage
    committed before then. Returns (their keys, every id in them, their held-out ids that none of
    them trains on), or None when unknown (no ``promoted_at``, or no such stage left)."""
    import pyarrow.parquet as pq

    from campaign_orchestrator.stage_dir import MANIFEST, SUCCESS

    try:  # promoted_at has whole seconds: a stage committed in the same second counts as before
        cutoff = dt.datetime.fromisoformat(promoted_at) + dt.timedelta(seconds=1) if promoted_at else None
    except ValueError:
        cutoff = None
    if cutoff is None:
        return None
    keys, trained, held = [], set(), set()
    stages = storage.campaign_dir(spec.name) / "prompts"
    for d in sorted(stages.iterdir()) if stages.is_dir() else []:
        if not (d / SUCCESS).exists():
            continue
        m = json.loads((d / MANIFEST).read_text())
        if dt.datetime.fromisoformat(m["committed_at"]) >= cutoff:
            continue
        keys.append(m["key"])
        trained |= set(pq.read_table(d / "train.parquet", columns=["id"]).column("id").to_pylist())
        held |= set(pq.read_table(d / "heldout.parquet", columns=["id"]).column("id").to_pylist())
    return (keys, trained | held, held - trained) if keys else None


def _pick_items(spec: CampaignSpec, rows: list[dict], seen: tuple | None, newest: list[Path], promoted_at):
    """``(items, fresh, earlier, new ids, summary)``: the fresh held-out items topped up with promotion-time ones
    when what the promoted model saw is known (``seen``: :func:`promotion_data`), else the current held-out split
    (fresh, earlier and new ids None)."""
    from campaign_orchestrator.dataset import prompts as P

    h, min_items = spec.data.heldout, spec.evaluation.gate.min_items
    if seen is None:  # unknown: the current split (its held-out items were held out then too)
        _, items = P.split(rows, h.fraction, h.seed, h.max_items)
        how = (
            f"what the promoted model saw is unknown (no prompts stage committed before its promoted_at "
            f"{promoted_at!r}): {len(items)} item(s) of the current held-out split"
        )
        return items, None, None, None, how
    fresh, earlier = P.fresh_heldout(
        rows, h.fraction, h.seed, seen[1], seen[2], [f.name for f in newest], h.max_items, min_items
    )
    items, new_ids = fresh + earlier, {r["id"] for r in rows if r["id"] not in seen[1]}
    used = sorted({r["source_file"] for r in fresh})
    how = (
        f"{len(fresh)} fresh held-out item(s) (prompts the promoted model never saw) from "
        f"{', '.join(used) or 'no file'}"
        + (
            f" + {len(earlier)} of its promotion-time held-out item(s) to reach the gate's min_items {min_items}"
            if earlier
            else ""
        )
    )
    return items, fresh, earlier, new_ids, how


def select_items(
    storage: Store, spec: CampaignSpec, promoted_at: str | None, files: list[Path], rows: list[dict]
) -> tuple[list[dict], dict]:
    """The held-out rows to re-score the promoted model on, and the record of how they were chosen."""
    from campaign_orchestrator.content import file_sha256

    h, min_items = spec.data.heldout, spec.evaluation.gate.min_items
    newest = sorted(files, key=lambda f: (f.stat().st_mtime_ns, f.name), reverse=True)
    seen = promotion_data(storage, spec, promoted_at)
    items, fresh, earlier, new_ids, how = _pick_items(spec, rows, seen, newest, promoted_at)

    def per_file(part):
        return None if part is None else Counter(r["source_file"] for r in part)

    counts = {
        "rows": per_file(rows),
        "new_rows": per_file(None if new_ids is None else [r for r in rows if r["id"] in new_ids]),
        "items": per_file(items),
        "fresh_items": per_file(fresh),
        "earlier_items": per_file(earlier),
    }
    record = {
        "summary": how,
        "promoted_at": promoted_at,
        "promotion_prompts": seen[0] if seen else None,
        "items": len(items),
        "fresh_items": None if fresh is None else len(fresh),
        "earlier_items": None if earlier is None else len(earlier),
        "min_items": min_items,
        "max_items": h.max_items,
        "files": [
            {"name": f.name, "sha256": file_sha256(f)}
            | {k: None if c is None else c[f.name] for k, c in counts.items()}
            for f in newest
        ],
    }
    return items, record


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The campaign's promoted model scored on fresh held-out items and the drift verdict (no inputs: it reads the
    promoted model), unless the stage's content key is complete."""
    promoted = current_promoted(spec, ctx.store)
    m, cached = materialize(ctx, spec, promoted)
    r = m["report"]
    ctx.log.info(f"drift verdict {r['verdict']}: {r['summary']}")
    return Outcome(m, cached)


def current_promoted(spec: CampaignSpec, storage: Store):
    """The campaign's promoted model (``evaluation.drift.Promoted``); a StageError naming what is missing without
    one."""
    from evaluation.drift import DriftError, current_promoted

    try:
        promoted = current_promoted(storage.campaign_dir(spec.name))
    except DriftError as e:
        raise StageError(str(e)) from None
    if promoted is None:
        raise StageError(
            f"campaign {spec.name} has no promoted model yet (no "
            f"{storage.campaign_dir(spec.name) / 'promoted_model' / 'CURRENT'}); run the campaign first"
        )
    return promoted


def _drift_suites(ctx, spec: CampaignSpec, storage: Store, promoted) -> tuple:
    """The fresh held-out items and the item suites they are scored by:
    ``(prompt files, held-out rows, item selection record, the spec's item suites, suites to score)``."""
    from campaign_orchestrator.dataset import prompts as P
    from campaign_orchestrator.triggers.sources import prompt_files
    from evaluation.scorers import build_scorer
    from evaluation.suite import load_items

    ev, d = spec.evaluation, spec.data
    files = prompt_files(d.source, spec.project_dir, source_cache_dir(storage, spec))
    rows = P.read_prompts(files, P.SourceFields(d.id_field, d.prompt_field, d.reference_field, d.category_field))
    held, selection = select_items(storage, spec, promoted.record.get("promoted_at"), files, rows)
    ctx.log.info(f"drift items: {selection['summary']}")
    item_suites = [s for s in ev.suites if s.kind == "items"]  # lm_eval suites are fixed documents: no drift
    scorers = {
        s.name: build_scorer(s.scorer, s.labels, s.pattern, s.json_schema, spec.project_dir) for s in item_suites
    }
    suites = [
        {
            "name": s.name,
            "items": load_items(s.source, held, spec.project_dir, scorers[s.name]),
            "scorer": scorers[s.name],
            "max_new_tokens": s.max_new_tokens,
        }
        for s in item_suites
    ]
    return files, held, selection, item_suites, suites


def content_key(spec: CampaignSpec, promoted, suites: list[dict], item_suites: list, selection: dict) -> str:
    """The stage's content key: promoted model, items, suites, thresholds, selection, endpoint."""
    from campaign_orchestrator.content import value_sha256

    ev = spec.evaluation
    served = ev.endpoint.model_dump(exclude={"api_key_env"}) if ev.backend == "openai" else None
    return stage_key(
        "drift/v2",
        promoted.key,
        value_sha256([s["items"] for s in suites]),
        [s.model_dump(exclude={"kind", "lm_eval"}) for s in item_suites],
        ev.gate.min_score,
        max_drop(spec),
        ev.statistics.confidence,
        ev.gate.min_items,
        selection,
        served,
    )


def materialize(ctx, spec: CampaignSpec, promoted) -> tuple[dict, bool]:
    """The promoted model scored on fresh held-out items and the drift verdict, unless the stage's content key
    (promoted model, items, suites, thresholds, selection, endpoint) is complete: ``(manifest, cached)``."""
    from evaluation.drift import decide, score_promoted
    from evaluation.suite import write_item_rows

    ev, storage, pricing = spec.evaluation, ctx.store, ctx.pricing
    files, held, selection, item_suites, suites = _drift_suites(ctx, spec, storage, promoted)
    floor, drop, conf = ev.gate.min_score, max_drop(spec), ev.statistics.confidence
    sd = storage.stage(spec.name, STAGE, content_key(spec, promoted, suites, item_suites, selection))
    cached = sd.is_complete()
    if not cached:
        from types import SimpleNamespace

        # priced and inside the campaign's budget, like evaluation (stopped between suites when it would pass)
        device = _local_device(spec)  # None: an endpoint, billed nowhere here (as in evaluation)
        guard = pricing.guard(ctx, spec, sd, device=device)
        t0 = time.perf_counter()
        generate = _promoted_model(spec, storage, promoted, ctx)
        scores, item_rows = score_promoted(
            generate, [SimpleNamespace(**s) for s in suites], log=ctx.log.info, progress=guard.watch()
        )
        report = decide(scores, _promotion_scores(promoted, item_suites), floor, drop, ev.gate.min_items, conf)
        out = sd.ensure()
        write_item_rows(item_rows, out / "items.parquet")
        (out / "drift.json").write_text(json.dumps(report.as_dict() | {"item_selection": selection}, indent=2))
        wall = time.perf_counter() - t0
        bill = pricing.bill(spec, STAGE, {"seconds": wall, "device": device}) if device else None
        lines, note = (bill["lines"], bill["billing_note"]) if bill else ([], None)
        sd.commit(
            {
                "promoted_key": promoted.key,
                "report": report.as_dict(),
                "heldout_items": len(held),
                "item_selection": selection,
                "source_files": [f.name for f in files],
                "backend": ev.backend,
                "wall_seconds": wall,
                "cost_lines": lines,
                **({"billing_note": note} if note else {}),
            }
        )
        _record_cost(ctx, spec, sd.manifest())
    return sd.manifest(), cached


def _promotion_scores(promoted, suites) -> dict[str, list[float] | None]:
    """suite -> the promoted candidate's per-item scores at promotion (None: that suite was not scored)."""
    items = promoted.item_scores()
    return {s.name: items.get(s.name) for s in suites}


def _local_device(spec: CampaignSpec) -> str | None:
    """Where the promoted model runs when scored locally ("cuda"/"cpu"), None through an endpoint."""
    if spec.evaluation.backend == "openai":
        return None
    from stages.evaluation import local_device

    return local_device()


def _promoted_model(spec: CampaignSpec, storage: Store, promoted, ctx):
    """The promoted model's ``generate`` through the campaign's evaluation backend."""
    ev, q = spec.evaluation, spec.student.quantization
    if ev.backend == "openai":
        from evaluation.endpoint import AdapterNotVerified, OpenAIEndpoint

        e = ev.endpoint
        name = e.candidate_model
        ep = OpenAIEndpoint(e.base_url, name or "", api_key_env=e.api_key_env, timeout_s=e.timeout_s)
        if e.load_adapter:
            name = f"{spec.name}-{promoted.key}"
            ep.load_adapter(name, str(promoted.adapter_path))
        try:  # the score is the promoted adapter's only if the server serves exactly it
            ep.verify_adapter(name, promoted.adapter_path)
        except AdapterNotVerified as err:
            raise StageError(str(err), retry=False) from None
        ctx.log.info(f"scoring the promoted model through {e.base_url} as {name!r}")
        return OpenAIEndpoint(
            e.base_url, name, api_key_env=e.api_key_env, max_concurrency=e.max_concurrency, timeout_s=e.timeout_s
        ).generate
    from evaluation.drift import local_generate

    base = promoted.base_model_path()
    if base is None or not base.exists():
        base = storage.resolve_model(spec.student.base_model, spec.project_dir)
    return local_generate(
        base,
        promoted.adapter_path,
        q.load_in_4bit,
        q.compute_dtype,
        max((s.batch_size for s in ev.suites if s.kind == "items"), default=64),
    )


def _record_cost(ctx, spec: CampaignSpec, manifest: dict) -> None:
    """The drift check's spend in the cost ledger (it has no IO manager output to record it)."""
    ctx.pricing.ledger_at(ctx.store.root_path()).record_stage(
        campaign=spec.name,
        asset=STAGE,
        run_id=ctx.run_id,
        step_key=ctx.step_key,
        manifest=manifest,
        attempt=ctx.attempt,
    )
