"""evaluation: candidate (base + adapter) and base answer the same suite items with the same settings, and the gate
judges them (its verdict is what the blocking ``gate`` check of the Dagster asset reports, so NO-GO or INCONCLUSIVE
stops promotion in the same run).

Two stage directories: ``evaluation_items/<key>`` holds every model's answers (slow to make; keyed by adapter, items,
models and generation settings) and ``evaluation/<key>`` the gate's judgement of them (fast; keyed by the answers
and the gate policy), so changing a threshold re-judges stored answers instead of generating them again. Where the
local models and the teacher answer is the executor's choice (:func:`stages.executors.executor_for`); the endpoint
backend (``evaluation.backend: openai``) asks a served model instead.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from campaign_orchestrator.content import file_sha256
from campaigns.spec import CampaignSpec, SuiteSpec
from evaluation.judging import approve_hint, review_line, tally  # noqa: F401 - approve_hint, review_line: re-exported
from stages.answers import local_quantization_key
from stages.common import model_identity, stage_key
from stages.diagnosis import distillation_conflicts, score_training_sample
from stages.errors import BudgetStopped, StageError
from stages.executors import executor_for
from stages.harness import harness_identity, harness_models, harness_suites, is_harness
from stages.outcome import Outcome
from stages.pricing import accrue_also

STAGE = "evaluation"


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """Every model's answers (made unless their content key is complete) judged by the gate (``inputs``: the
    ``prompts`` and ``adapter`` manifests): the judgement's manifest, found complete when the judgement itself was
    (``cached``); ``notes["answers_reused"]``: the answers were stored already (a changed gate re-judges them),
    ``notes["report"]``: the gate's report, ``notes["mlflow_runs_tagged"]``: the training runs tagged with the
    verdict (``tracking.mlflow``)."""
    prompts, adapter = inputs["prompts"], inputs["adapter"]
    scorers = item_scorers(spec)
    isd, items_key, cached = answers_stage(ctx, spec, prompts, adapter, scorers)
    judged = judgement_dir(spec, ctx.store, items_key).is_complete()
    m = judge_answers(spec, ctx.store, isd, items_key, scorers, adapter)
    report = json.loads(open(m["gate_path"]).read())
    notes: dict = {"report": report, "answers_reused": cached}
    if spec.tracking.mlflow is not None and not cached:  # the training run's verdict (stages/tracking.py)
        from stages.tracking import set_verdict

        notes["mlflow_runs_tagged"] = set_verdict(spec, ctx.store.root_path(), m["candidate_key"], report["verdict"])
    return Outcome(m, cached and judged, notes)


def gate_rules(report: dict) -> list[dict]:
    """Every rule of every suite of a gate report (``gate.json``) for people: ``suite``, ``rule``, ``measured`` (a
    share in percent; a change against the base in points of percent, with the interval the rule judges; seconds;
    items), ``threshold`` (with the side the value must be on), ``result`` (PASS, BREACH, INSUFFICIENT_EVIDENCE),
    ``advisory`` (never blocks)."""
    from evaluation.report import rule_threshold, rule_value

    rows = []
    for s in report["suites"]:
        for r in s["rules"]:
            measured = rule_value(r["rule"], r["value"])
            if r["value"] is None or r["value"] != r["value"]:  # nothing measured (e.g. one category): why
                measured = f"not measured ({r['detail']})"
            elif r["rule"] == "max_regression_vs_base":  # the rule judges the interval's low end
                measured += f" {points_interval(s['overall']['delta'])}"
            rows.append(
                {
                    "suite": s["suite"],
                    "rule": r["rule"],
                    "measured": measured,
                    "threshold": rule_threshold(r["rule"], r["threshold"]),
                    "result": r["status"],
                    "advisory": r.get("tier") == "advisory",
                }
            )
    return rows


def gate_scores(suite: dict) -> str:
    """A suite of a gate report for people: the candidate's and the base's score on the paired items, in percent,
    and the change with its interval, in points of percent."""
    o = suite["overall"]

    def pct(iv: dict) -> str:
        x = iv.get("estimate")
        return "n/a" if x is None or x != x else f"{x:.1%}"

    d = o["delta"]
    change = "n/a" if d["estimate"] != d["estimate"] else f"{d['estimate'] * 100:+.1f} pts {points_interval(d)}"
    return f"candidate {pct(o['candidate'])}, base {pct(o['base'])}, candidate − base {change} on {o['n']} items"


def points_interval(iv: dict) -> str:
    """An interval of a change (fractions) in points of percent: ``[+1.0, +7.5]``, ``[undefined]``."""
    lo, hi = iv.get("lo"), iv.get("hi")
    if lo is None or hi is None or lo != lo or hi != hi:
        return "[undefined]"
    return f"[{lo * 100:+.1f}, {hi * 100:+.1f}]"


def _suite_identity(spec: CampaignSpec, x: SuiteSpec, harness: list | None = None) -> dict:
    """What changes a suite's answers or scores (not its gate or tier)."""
    if x.kind == "lm_eval":
        return harness_identity(x, harness or [])
    ident = x.model_dump(exclude={"gate", "tier", "kind", "lm_eval"})  # (as before lm_eval suites: same keys)
    if x.source != "heldout":
        p = spec.path(x.source)
        ident["source_sha256"] = file_sha256(p) if p.exists() else None
    if isinstance(x.json_schema, str):
        p = spec.path(x.json_schema)
        ident["schema_sha256"] = file_sha256(p) if p.exists() else None
    return ident


def teacher_scorer(spec: CampaignSpec, ctx, executor, categories: dict[str, str] | None = None, budget=None) -> tuple:
    """A ``generate(prompts, max_new_tokens)`` that asks the campaign's teacher, whatever its backend,
    through its generation cache (greedy, the suite's length: the settings every compared model answers
    with; a prompt it already answered so is never paid for again), with its ``teacher.context`` as it
    answered the training prompts (only before prompts of ``teacher.context_categories``: ``categories``
    maps a prompt to its item's category), and what it spent: ``lines`` at the teacher's one price (kind
    ``evaluation``), ``unknown`` when that price is ``unpriced``, ``seconds``. It answers where ``executor`` runs
    (here, a Ray pool, a KubeRay RayJob per answer length; ``budget``: the stage's guard, checked while a RayJob
    runs; its stop fails the stage, never the teacher's items)."""
    from campaign_orchestrator.generation.requests import Sampling
    from campaign_orchestrator.generation.runner import GenerationResult, GenerationStats, answers
    from stages.pricing import tag_lines
    from stages.teacher import route, teacher_setup

    spend: dict = {"lines": [], "unknown": False, "seconds": 0.0}

    def ask_one(view: CampaignSpec, rows: list[dict], sampling, sub: str):
        backend, _cache, tm = teacher_setup(ctx, view, sampling)
        res, lines, ray_md = executor.at(f"{sub}@{sampling.max_new_tokens}").teacher(
            ctx,
            view,
            backend,
            rows,
            sampling,
            tm,
            "teacher_scoring",
            log=ctx.log.info,
            remote_budget=budget,
            free_if_cached=True,
        )
        if ray_md is not None:
            spend.setdefault("ray", []).append(ray_md)
        return res, lines

    def ask(rows: list[dict], sampling):
        if not spec.several_teachers:
            return ask_one(spec, rows, sampling, "teacher")
        # each teacher scored on its own categories: its answers, its price, its lines
        answered, stats, lines = {}, [], []
        for name, part in route(spec, rows).items():
            if not part:
                continue
            view, t0 = spec.for_teacher(name), time.perf_counter()
            res, got = ask_one(view, part, sampling, f"teacher-{name}")
            if not view.teacher.api:
                spend["local_seconds"] = spend.get("local_seconds", 0.0) + time.perf_counter() - t0
            answered |= {r["id"]: r | {"teacher": name} for r in res.rows}
            stats.append(res.stats)
            tally(spend.setdefault("teachers", {}), name, res.stats)
            lines = None if got is None or lines is None else lines + tag_lines(got, name)
        return GenerationResult([answered[r["id"]] for r in rows], GenerationStats.merged(stats)), lines

    def generate(prompts, max_new_tokens):
        sampling = Sampling(max_new_tokens=max_new_tokens)
        rows = [{"id": str(i), "prompt": p, "category": (categories or {}).get(p)} for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        try:
            res, lines = ask(rows, sampling)
        except Exception as e:  # noqa: BLE001 - an unreachable teacher is an error on its items, not a failed gate
            if isinstance(e, BudgetStopped):  # the stage's budget, not the teacher: the stage stops
                raise
            ctx.log.info(f"teacher could not be scored: {e}")
            return [SimpleNamespace(text="", latency_s=0.0, error=f"teacher: {e}"[:300]) for _ in prompts]
        finally:
            spend["seconds"] += time.perf_counter() - t0
        st = res.stats
        ctx.log.info(
            f"teacher on {len(prompts)} held-out prompts: {st.cache_hits} from the generation cache, {st.generated} "
            "generated"
        )
        tally(spend, "answers", st)
        if lines is None:  # cache hits cost nothing
            spend["unknown"] = True
        else:
            spend["lines"] += lines
        return answers(res.rows)

    return generate, spend


def item_scorers(spec: CampaignSpec) -> dict:
    """A scorer per item suite (lm_eval suites score themselves)."""
    from evaluation.scorers import build_scorer

    return {
        x.name: build_scorer(x.scorer, x.labels, x.pattern, x.json_schema, spec.project_dir)
        for x in spec.evaluation.suites
        if not is_harness(x)
    }


def answers_stage(ctx, spec: CampaignSpec, prompts: dict, adapter: dict, scorers: dict):
    """The answers stage ``(stage dir, key, cached)``, every model's answers made (:func:`answer_items`) unless
    its content key is complete."""
    storage = ctx.store
    local = spec.evaluation.backend == "local"
    harness = harness_suites(spec, storage)  # lm_eval suites: their task directories, content-addressed
    base = storage.resolve_model(spec.student.base_model, spec.project_dir) if local else None
    items_key = content_key(spec, storage, prompts, adapter, base, harness)
    isd = storage.stage(spec.name, "evaluation_items", items_key)
    cached = isd.is_complete()
    if not cached:
        answer_items(ctx, spec, isd, items_key, prompts, adapter, base, scorers, harness)
    return isd, items_key, cached


def judgement_dir(spec: CampaignSpec, storage, items_key: str):
    """The judgement's stage directory: keyed by the answers and the gate policy."""
    from evaluation.judging import judging_key

    return storage.stage(spec.name, STAGE, judging_key(spec, items_key))


def judge_answers(spec: CampaignSpec, storage, isd, items_key: str, scorers: dict, adapter: dict):
    """The gate's judgement of the stored answers (its own stage, keyed by the answers and the gate policy)."""
    from evaluation.judging import judge_stage

    return judge_stage(
        spec,
        judgement_dir(spec, storage, items_key),
        isd.manifest(),
        items_key,
        {n: sc.binary for n, sc in scorers.items()},
        adapter["key"],
        conflicts=distillation_conflicts(spec, storage),
    )


def content_key(spec: CampaignSpec, storage, prompts: dict, adapter: dict, base, harness: list) -> str:
    """The answers stage's content key: adapter, held-out items, the base's weights, the teacher as its
    generations know it (backend + weights or endpoint) and how it is asked, the local quantization or the
    served endpoint, every suite's identity."""
    ev, s, t = spec.evaluation, spec.student, spec.teacher
    local = ev.backend == "local"
    teacher_id = context = None
    if ev.score_teacher:
        from stages.teacher import teacher_model

        teacher_id = [teacher_model(storage, spec).identity, t.chat]
        context = [[m.model_dump() for m in t.context], t.context_categories]
    if ev.score_teacher and spec.several_teachers:  # each teacher, the categories it answers and how it is asked
        views = [(e, spec.for_teacher(e).teacher) for e in spec.teachers]
        teacher_id = [
            [e.name, e.categories, teacher_model(storage, spec.for_teacher(e)).identity, v.chat] for e, v in views
        ]
        context = [[[m.model_dump() for m in v.context], v.context_categories] for _e, v in views]
    served = ev.endpoint.model_dump(exclude={"api_key_env"}) if ev.endpoint and not local else None
    return stage_key(
        "evaluation-items/v4",
        adapter["key"],
        prompts["heldout_sha256"],
        model_identity(base, s.revision) if base else None,
        teacher_id,
        context,
        local_quantization_key(s.quantization) if local else None,
        served,
        [_suite_identity(spec, x, harness) for x in ev.suites],
    )


def answer_items(
    ctx, spec: CampaignSpec, isd, items_key: str, prompts: dict, adapter: dict, base, scorers: dict, harness: list
) -> None:
    """Every model answers every item (the harness's suites first), under the stage's budget guard; the answers,
    their cost and counts committed to ``isd``."""
    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from evaluation.judging import answers_manifest
    from evaluation.runner import SuiteRun, answer_suites
    from evaluation.suite import load_items, write_item_rows

    ev, local = spec.evaluation, spec.evaluation.backend == "local"
    # refuses to start when the planner's estimate exceeds the budget left; checked again from
    # actual spend after each model's suite
    # a GPU-priced evaluation without a GPU: refused now (on KubeRay: the Ray workers' device)
    device = (ray_device(spec) if spec.execution.kuberay is not None else local_device()) if local else None
    guard = ctx.pricing.guard(ctx, spec, ctx.store.stage(spec.name, STAGE, items_key), device=device)
    t0 = time.perf_counter()
    held = read_prompt_table(prompts["heldout_path"])
    runs = [
        SuiteRun(
            x.name, load_items(x.source, held, spec.project_dir, scorers[x.name]), scorers[x.name], x.max_new_tokens
        )
        for x in ev.suites
        if not is_harness(x)
    ]
    progress = guard.watch()
    harness_run = _run_harness(spec, harness, adapter, base, isd, ctx, progress)  # before any other model
    dtypes: dict[str, str] = {}
    executor = executor_for(spec, STAGE, ctx, isd.path / "ray")
    models, spend = _answerers(ctx, spec, executor, adapter, base, runs, dtypes, guard)
    out = isd.ensure()
    with executor.session(ctx.log.info):  # engine ray: one Ray cluster for every model
        rows = answer_suites(runs, models, log=ctx.log.info, progress=progress) if runs else []
        sample = score_training_sample(spec, prompts, models, scorers, out, ctx.log.info)  # the diagnosis's
    rows += harness_run.rows if harness_run else []
    write_item_rows(rows, out / "items.parquet")
    wall = time.perf_counter() - t0
    # local models' time on the hardware they ran on; the teacher at its own price (its seconds not twice)
    local_s = wall - _teacher_local_seconds(spec, spend)
    parts = {"lm_eval": harness_run.wall_seconds} if harness_run else {}
    bill = ctx.pricing.bill(spec, STAGE, {"seconds": local_s, "device": device, "parts": parts}) if local else None
    isd.commit(
        answers_manifest(out / "items.parquet", len(rows), adapter["key"], wall, bill, spend, dtypes, harness_run)
        | {"train_sample_path": sample}
    )


def _teacher_local_seconds(spec: CampaignSpec, spend: dict | None) -> float:
    """The seconds a self-hosted teacher answered in (billed at its own hardware, so not in the local models' time;
    an API teacher's wait is the host's time too); several teachers: the self-hosted ones'."""
    if not spend:
        return 0.0
    if spec.several_teachers:
        return spend.get("local_seconds", 0.0)
    return spend["seconds"] if not spec.teacher.api else 0.0


def _answerers(
    ctx, spec: CampaignSpec, executor, adapter: dict, base, runs: list, dtypes: dict, guard
) -> tuple[dict, dict | None]:
    """role -> factory of the role's ``generate``, and the teacher's spend (None when it is not scored); the
    guard accrues the teacher's spend as well as the time."""
    categories = {it["prompt"]: it["category"] for r in runs for it in r.items}
    models = _models(spec, ctx, executor, adapter, base, dtypes, budget=guard)
    if not spec.evaluation.score_teacher:
        return models, None
    ask_teacher, spend = teacher_scorer(spec, ctx, executor, categories, budget=guard)
    models["teacher"] = lambda: ask_teacher
    guard.line_fn = accrue_also(guard.line_fn, spend["lines"])  # the teacher's spend as well as the time
    return models, spend


def local_device() -> str:
    """Where local evaluation runs ("cuda" where torch sees a GPU, else "cpu"): it is billed at the hardware used
    (``training.hardware``; without a GPU a GPU entry is refused unless ``training.allow_cpu_fallback``)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_harness(spec: CampaignSpec, harness: list, adapter: dict, base, isd, ctx, progress):
    """The lm_eval suites, base and candidate through one harness process (its preflight refuses a
    broken suite before any model runs); None without lm_eval suites."""
    if not harness:
        return None
    if spec.evaluation.backend != "local":
        raise ValueError(
            "lm_eval suites run the models locally (transformers + PEFT); they need evaluation.backend: local"
        )
    from evaluation.harness import evaluate_suites

    return evaluate_suites(
        harness, harness_models(spec, adapter, base), isd.ensure() / "lm_eval", log=ctx.log.info, progress=progress
    )


def ray_device(spec: CampaignSpec) -> str:
    """Where the models answer on a KubeRay cluster: the Ray workers' device ("cuda" with GPUs per replica)."""
    return "cuda" if spec.execution.num_gpus_per_replica > 0 else "cpu"


def _models(spec: CampaignSpec, ctx, executor, adapter: dict, base, dtypes: dict | None = None, budget=None) -> dict:
    """role -> factory of a ``generate(prompts, max_new_tokens)`` callable (loaded when called) for the
    candidate and the base (the teacher is asked through its backend: :func:`teacher_scorer`); ``dtypes``
    collects each local model's resolved compute dtype. Local models answer where ``executor`` runs them (here, a
    Ray actor pool, a KubeRay RayJob per model and answer length; ``budget``: the stage's guard, checked while a
    RayJob runs); the endpoint backend asks the served models."""
    if spec.evaluation.backend == "openai":
        return _endpoint_models(spec, adapter, ctx)
    return {
        "candidate": executor.answerer(ctx, spec, "candidate", base, adapter, dtypes, budget),
        "base": executor.answerer(ctx, spec, "base", base, None, dtypes, budget),
    }


def _endpoint_models(spec: CampaignSpec, adapter: dict, ctx) -> dict:
    """Candidate and base through the campaign's OpenAI-compatible endpoint (``evaluation.endpoint``), after
    checking it serves exactly the candidate's adapter (loading it first with ``load_adapter``)."""
    from evaluation.endpoint import AdapterNotVerified, OpenAIEndpoint

    ev = spec.evaluation
    e = ev.endpoint
    cand_name = e.candidate_model
    ep = OpenAIEndpoint(e.base_url, cand_name or "", api_key_env=e.api_key_env, timeout_s=e.timeout_s)
    if e.load_adapter:
        cand_name = f"{spec.name}-{adapter['key']}"
        ep.load_adapter(cand_name, adapter["adapter_path"])
        ctx.log.info(f"loaded adapter {adapter['adapter_path']} into {e.base_url} as {cand_name}")
    try:  # no score is credited to this candidate unless the server serves exactly its adapter
        checked = ep.verify_adapter(cand_name, adapter["adapter_path"])
    except AdapterNotVerified as err:
        raise StageError(str(err), retry=False) from None
    ctx.log.info(
        f"{e.base_url} serves {cand_name!r} from {checked['root']}: the candidate's adapter "
        f"(content {checked['fingerprint'][:12]})"
    )

    def endpoint(name):
        return lambda: (
            OpenAIEndpoint(
                e.base_url, name, api_key_env=e.api_key_env, max_concurrency=e.max_concurrency, timeout_s=e.timeout_s
            ).generate
        )

    return {"candidate": endpoint(cand_name), "base": endpoint(e.base_model)}


def models_read(spec: CampaignSpec) -> list[str]:
    """The model references the stage reads here: the student's base when the models answer locally, the teacher
    when it is scored and runs here (not an API)."""
    ev, s = spec.evaluation, spec.student
    local = ev.backend == "local"
    scored = [e.model for e in spec.teachers if not e.api] if ev.score_teacher else []
    return ([s.base_model] if local else []) + list(dict.fromkeys(scored))


def where_models_answer(spec: CampaignSpec) -> str:
    """Where candidate and base answer, for people."""
    ev = spec.evaluation
    return "locally (transformers + PEFT)" if ev.backend == "local" else f"through the endpoint {ev.endpoint.base_url}"
