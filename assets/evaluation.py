"""evaluation: candidate (base + adapter) and base answer the same suite items with the same
settings; the gate is a blocking asset check on this asset (:func:`gate`), so NO-GO or
INCONCLUSIVE stops promotion in the same run.

The check is a step of its own after the evaluation's materialization: it reads the judgement the
evaluation step wrote (``gate.json``, through the manifest the evaluation materialized) and fails
its own step on anything but GO (the evaluation step succeeds), so the steps downstream
(``promoted_model``, ``campaign_cost``) are skipped. Its evaluation is stored after the materialization it judges and
names it as its
target.

Two stage directories: ``evaluation_items/<key>`` holds every model's answers (slow to make;
keyed by adapter, items, models and generation settings) and ``evaluation/<key>`` the gate's
judgement of them (fast; keyed by the answers and the gate policy), so changing a threshold
re-judges stored answers instead of generating them again.
"""

import json
import time

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetIn,
    MetadataValue,
    Output,
    asset,
    asset_check,
)

from assets.common import base_metadata, for_people, key, model_deps, model_identity, stage_key, tag_run
from assets.diagnosis import distillation_conflicts, score_training_sample
from assets.harness import harness_identity, harness_models, harness_suites, is_harness
from campaign_orchestrator.content import file_sha256
from campaigns.spec import CampaignSpec, SuiteSpec
from evaluation.judging import approve_hint, review_line, tally  # noqa: F401 - approve_hint, review_line: re-exported
from resources.k8s.kuberay_launcher import KubeRayJobLauncher
from resources.pricing import BudgetStop, PricingResource
from resources.storage import ArtifactStore
from resources.teacher import TeacherResource

GATE_CHECK = "gate"
GATE_DESCRIPTION = (
    "Promotion gate: floors, regression vs base on paired intervals, per-category regression, empty "
    "outputs, latency, serving errors."
)


def gate_check_result(report: dict, evaluation_key: str | None = None) -> AssetCheckResult:
    verdict = report["verdict"]
    md = {
        "verdict": verdict,
        "candidate_key": report.get("candidate_key", ""),
        "reasons": MetadataValue.md("\n".join(f"- {r}" for r in report["reasons"]) or "- every rule passes"),
    }
    if evaluation_key:
        md["evaluation_key"] = evaluation_key
    for s in report["suites"]:
        o = s["overall"]
        nan = float("nan")
        md[f"{s['suite']}_candidate"] = s["candidate"]["score"] if s["candidate"]["score"] is not None else nan
        md[f"{s['suite']}_base"] = s["base"]["score"] if s["base"]["score"] is not None else nan
        md[f"{s['suite']}_delta_lo"] = o["delta"]["lo"]
        md[f"{s['suite']}_delta_hi"] = o["delta"]["hi"]
        md[f"{s['suite']}_verdict"] = s["verdict"]
    return AssetCheckResult(
        check_name=GATE_CHECK,
        passed=verdict == "GO",
        severity=AssetCheckSeverity.ERROR,
        metadata=md,
        description=f"Gate verdict {verdict}",
    )


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


def _ask_teacher(
    spec: CampaignSpec, resources: tuple, rows: list[dict], sampling, log, spend: dict, launch=None, budget=None
) -> tuple:
    """One round of :func:`teacher_scorer`'s questions through the teacher's generation cache, locally or (engine
    ``ray``) sharded on the stage's Ray cluster and billed per shard: ``(result, the Ray run's cost lines)``
    (``resources``: storage, teacher, pricing)."""
    from assets.teacher_generations import teacher_setup
    from campaign_orchestrator.generation.runner import run_generation

    storage, teacher, pricing = resources
    t = spec.teacher
    backend, cache, identity, _store = teacher_setup(storage, teacher, spec, sampling)
    if spec.execution.engine != "ray":
        res = run_generation(
            rows,
            backend,
            sampling,
            cache,
            chat=t.chat,
            context=[m.model_dump() for m in t.context],
            context_categories=t.context_categories,
            log=log,
        )
        return res, None
    from assets.teacher_generations import teacher_model_path, teacher_on_ray

    tpath = teacher_model_path(storage, spec)
    res, ray_lines, ray_md = teacher_on_ray(
        spec,
        storage,
        pricing,
        rows,
        sampling,
        tpath,
        model_identity(tpath, t.revision) if tpath is not None else None,
        identity,
        "teacher_scoring",
        log,
        launch=launch and launch.at(f"teacher@{sampling.max_new_tokens}"),
        **({"budget": budget} if spec.execution.kuberay is not None else {}),
    )
    spend.setdefault("ray", []).append(ray_md)
    return res, ray_lines


def teacher_scorer(
    spec: CampaignSpec,
    storage: ArtifactStore,
    teacher: TeacherResource,
    pricing: PricingResource,
    log,
    categories: dict[str, str] | None = None,
    launch=None,
    budget=None,
) -> tuple:
    """A ``generate(prompts, max_new_tokens)`` that asks the campaign's teacher, whatever its backend,
    through its generation cache (greedy, the suite's length: the settings every compared model answers
    with; a prompt it already answered so is never paid for again), with its ``teacher.context`` as it
    answered the training prompts (only before prompts of ``teacher.context_categories``: ``categories``
    maps a prompt to its item's category), and what it spent: ``lines`` at the teacher's one price (kind
    ``evaluation``), ``unknown`` when that price is ``unpriced``, ``seconds``. With ``execution.engine: ray`` it
    answers on Ray, as a KubeRay RayJob through ``launch`` when the campaign sets ``execution.kuberay`` (``budget``:
    the stage's guard, checked while the job runs; its stop fails the stage, never the teacher's items)."""
    from types import SimpleNamespace

    from assets.teacher_generations import teacher_usage
    from campaign_orchestrator.generation.requests import Sampling
    from campaign_orchestrator.generation.runner import answers

    spend: dict = {"lines": [], "unknown": False, "seconds": 0.0}
    resources = (storage, teacher, pricing)

    def generate(prompts, max_new_tokens):
        sampling = Sampling(max_new_tokens=max_new_tokens)
        rows = [{"id": str(i), "prompt": p, "category": (categories or {}).get(p)} for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        try:
            res, ray_lines = _ask_teacher(spec, resources, rows, sampling, log, spend, launch, budget)
        except Exception as e:  # noqa: BLE001 - an unreachable teacher is an error on its items, not a failed gate
            if isinstance(e, BudgetStop):  # the stage's budget, not the teacher: the stage stops
                raise
            log(f"teacher could not be scored: {e}")
            return [SimpleNamespace(text="", latency_s=0.0, error=f"teacher: {e}"[:300]) for _ in prompts]
        finally:
            spend["seconds"] += time.perf_counter() - t0
        st = res.stats
        log(
            f"teacher on {len(prompts)} held-out prompts: {st.cache_hits} from the generation cache, {st.generated} "
            "generated"
        )
        tally(spend, "answers", st)
        lines = (
            []
            if not st.generated
            else ray_lines
            if spec.execution.engine == "ray"
            else pricing.bill(spec, "teacher_scoring", teacher_usage(st))["lines"]
        )  # cache hits cost nothing
        if lines is None:
            spend["unknown"] = True
        else:
            spend["lines"] += lines
        return answers(res.rows)

    return generate, spend


def build(spec: CampaignSpec):
    ev, s, t = spec.evaluation, spec.student, spec.teacher
    local = ev.backend == "local"
    refs = ([s.base_model] if local else []) + ([t.model] if ev.score_teacher and not t.api else [])
    where = "locally (transformers + PEFT)" if local else f"through the endpoint {ev.endpoint.base_url}"

    @asset(
        key=key(spec, "evaluation"),
        group_name=spec.name,
        kinds={"pytorch", "parquet"},
        ins={"prompts": AssetIn(key(spec, "prompts")), "adapter": AssetIn(key(spec, "student_adapter"))},
        deps=model_deps(*refs),
        description=f"Candidate and base answer the same items of {len(ev.suites)} suite(s) {where}; "
        "the blocking `gate` check decides promotion.",
    )
    def evaluation(
        context: AssetExecutionContext,
        prompts: dict,
        adapter: dict,
        storage: ArtifactStore,
        pricing: PricingResource,
        teacher: TeacherResource,
        kuberay: KubeRayJobLauncher,
    ):
        scorers = item_scorers(spec)
        resources = (storage, pricing, teacher, kuberay)
        isd, items_key, cached = answers_stage(context, spec, prompts, adapter, scorers, resources)
        m = judge_answers(spec, storage, isd, items_key, scorers, adapter)
        report = json.loads(open(m["gate_path"]).read())
        md = evaluation_metadata(m, report, cached)
        if spec.tracking.mlflow is not None and not cached:  # the training run's verdict (assets/tracking.py)
            from assets.tracking import set_verdict

            md["mlflow_runs_tagged"] = set_verdict(spec, storage.root_path(), m["candidate_key"], report["verdict"])
        tag_run(context, verdict=report["verdict"])  # the runs list shows the verdict (assets/common.py)
        return Output(m, metadata=for_people(md))

    return evaluation


def item_scorers(spec: CampaignSpec) -> dict:
    """A scorer per item suite (lm_eval suites score themselves)."""
    from evaluation.scorers import build_scorer

    return {
        x.name: build_scorer(x.scorer, x.labels, x.pattern, x.json_schema, spec.project_dir)
        for x in spec.evaluation.suites
        if not is_harness(x)
    }


def answers_stage(context, spec: CampaignSpec, prompts: dict, adapter: dict, scorers: dict, resources: tuple):
    """The answers stage ``(stage dir, key, cached)``, every model's answers made (:func:`answer_items`) unless
    its content key is complete (``resources``: storage, pricing, teacher, kuberay)."""
    storage = resources[0]
    local = spec.evaluation.backend == "local"
    harness = harness_suites(spec, storage)  # lm_eval suites: their task directories, content-addressed
    base = storage.resolve_model(spec.student.base_model, spec.project_dir) if local else None
    items_key = answers_key(spec, storage, prompts, adapter, base, harness)
    isd = storage.stage(spec.name, "evaluation_items", items_key)
    cached = isd.is_complete()
    if not cached:
        answer_items(context, spec, isd, items_key, prompts, adapter, base, scorers, harness, resources)
    return isd, items_key, cached


def judge_answers(spec: CampaignSpec, storage: ArtifactStore, isd, items_key: str, scorers: dict, adapter: dict):
    """The gate's judgement of the stored answers (its own stage, keyed by the answers and the gate policy)."""
    from evaluation.judging import judge_stage, judging_key

    return judge_stage(
        spec,
        storage.stage(spec.name, "evaluation", judging_key(spec, items_key)),
        isd.manifest(),
        items_key,
        {n: sc.binary for n, sc in scorers.items()},
        adapter["key"],
        conflicts=distillation_conflicts(spec, storage),
    )


def gate(spec: CampaignSpec):
    """The blocking ``gate`` check of the campaign's evaluation: its own step, run after the evaluation's
    materialization, judging what that step wrote (the verdict in its ``gate.json``)."""

    @asset_check(asset=key(spec, "evaluation"), name=GATE_CHECK, blocking=True, description=GATE_DESCRIPTION)
    def gate_check(evaluation: dict) -> AssetCheckResult:
        with open(evaluation["gate_path"]) as f:
            report = json.load(f)
        return gate_check_result(report, evaluation["key"])

    return gate_check


def answers_key(spec: CampaignSpec, storage: ArtifactStore, prompts: dict, adapter: dict, base, harness: list) -> str:
    """The answers stage's content key: adapter, held-out items, the base's weights, the teacher as its
    generations know it (backend + weights or endpoint) and how it is asked, the local quantization or the
    served endpoint, every suite's identity."""
    ev, s, t = spec.evaluation, spec.student, spec.teacher
    local = ev.backend == "local"
    teacher_id = None
    if ev.score_teacher:
        from assets.teacher_generations import teacher_model_path
        from campaign_orchestrator.generation.backends import spec_identity

        tpath = teacher_model_path(storage, spec)
        teacher_id = [spec_identity(t, tpath, model_identity(tpath, t.revision) if tpath else None), t.chat]
    served = ev.endpoint.model_dump(exclude={"api_key_env"}) if ev.endpoint and not local else None
    return stage_key(
        "evaluation-items/v4",
        adapter["key"],
        prompts["heldout_sha256"],
        model_identity(base, s.revision) if base else None,
        teacher_id,
        [[m.model_dump() for m in t.context], t.context_categories] if ev.score_teacher else None,
        local_quantization_key(s.quantization) if local else None,
        served,
        [_suite_identity(spec, x, harness) for x in ev.suites],
    )


def answer_items(
    context: AssetExecutionContext,
    spec: CampaignSpec,
    isd,
    items_key: str,
    prompts: dict,
    adapter: dict,
    base,
    scorers: dict,
    harness: list,
    resources: tuple,
) -> None:
    """Every model answers every item (the harness's suites first), under the stage's budget guard; the answers,
    their cost and counts committed to ``isd`` (``resources``: storage, pricing, teacher, kuberay)."""
    from campaign_orchestrator.dataset.prompts import read_prompt_table
    from evaluation.judging import answers_manifest
    from evaluation.runner import SuiteRun, answer_suites
    from evaluation.suite import load_items, write_item_rows

    storage, pricing, teacher, kuberay = resources
    ev, local = spec.evaluation, spec.evaluation.backend == "local"
    # refuses to start when the planner's estimate exceeds the budget left; checked again from
    # actual spend after each model's suite
    # a GPU-priced evaluation without a GPU: refused now (on KubeRay: the Ray workers' device)
    device = (ray_device(spec) if spec.execution.kuberay is not None else local_device()) if local else None
    guard = pricing.guard(context, spec, storage.stage(spec.name, "evaluation", items_key), device=device)
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
    harness_run = _run_harness(spec, harness, adapter, base, isd, context, progress)  # before any other model
    dtypes: dict[str, str] = {}
    models, spend = _answerers(context, spec, isd, adapter, base, runs, dtypes, guard, resources)
    out = isd.ensure()
    with _generation_engine(spec, context.log.info):  # engine ray: one Ray cluster for every model
        rows = answer_suites(runs, models, log=context.log.info, progress=progress) if runs else []
        sample = score_training_sample(spec, prompts, models, scorers, out, context.log.info)  # the diagnosis's
    rows += harness_run.rows if harness_run else []
    write_item_rows(rows, out / "items.parquet")
    wall = time.perf_counter() - t0
    # local models' time on the hardware they ran on; the teacher at its own price (its seconds not twice)
    local_s = wall - (spend["seconds"] if spend and not spec.teacher.api else 0.0)
    parts = {"lm_eval": harness_run.wall_seconds} if harness_run else {}
    bill = pricing.bill(spec, "evaluation", {"seconds": local_s, "device": device, "parts": parts}) if local else None
    isd.commit(
        answers_manifest(out / "items.parquet", len(rows), adapter["key"], wall, bill, spend, dtypes, harness_run)
        | {"train_sample_path": sample}
    )


def _answerers(
    context, spec: CampaignSpec, isd, adapter: dict, base, runs: list, dtypes: dict, guard, resources: tuple
) -> tuple[dict, dict | None]:
    """role -> factory of the role's ``generate``, and the teacher's spend (None when it is not scored); the
    guard accrues the teacher's spend as well as the time."""
    from assets.ray_dispatch import KubeRayLaunch

    storage, pricing, teacher, kuberay = resources
    categories = {it["prompt"]: it["category"] for r in runs for it in r.items}
    launch = KubeRayLaunch(context, kuberay, "evaluation", isd.path / "ray")  # with execution.kuberay
    models = _models(spec, adapter, base, context, dtypes, storage, launch=launch, budget=guard)
    if not spec.evaluation.score_teacher:
        return models, None
    ask_teacher, spend = teacher_scorer(
        spec, storage, teacher, pricing, context.log.info, categories, launch=launch, budget=guard
    )
    models["teacher"] = lambda: ask_teacher
    local_lines = guard.line_fn  # the guard accrues the teacher's spend as well as the time
    guard.line_fn = lambda seconds, items: local_lines(seconds, items) + spend["lines"]
    return models, spend


def evaluation_metadata(m: dict, report: dict, cached: bool) -> dict:
    """The judgement's manifest and report as Dagster metadata."""
    md = base_metadata(m, cached) | {
        "verdict": report["verdict"],
        "report": MetadataValue.md(report["markdown"]),
        "items": MetadataValue.path(m["items_path"]),
        "candidate_key": m["candidate_key"],
        "statistics": report["method"],
        "requires_human_review": m["requires_human_review"],
    }
    if report.get("diagnosis", {}).get("causes"):  # why, beside the verdict (evaluation/diagnosis.py)
        md["diagnosis"] = MetadataValue.md(report["diagnosis"]["markdown"])
    if m.get("compute_dtype"):
        md["compute_dtype"] = MetadataValue.json(m["compute_dtype"])
    if m.get("answers"):  # per role: generated in this run, found in the generation cache
        md["answers"] = MetadataValue.json(m["answers"])
    if m.get("ray_shards"):  # execution.engine ray: shards done/total per model and answer length
        md["ray_shards"] = MetadataValue.json(m["ray_shards"])
    md |= {k: m[k] for k in ("lm_eval_seconds", "lm_eval_usd") if k in m}
    for role, by_suite in m["scores"].items():
        for suite, score in by_suite.items():
            if score is not None:
                md[f"{suite}_{role}_score"] = score
    for suite, ratio in (m.get("student_teacher_ratio") or {}).items():
        if ratio is not None:
            md[f"{suite}_student_teacher_ratio"] = ratio
    if m.get("cost_unknown"):
        md |= {"cost_usd": m["cost_unknown"], "spent_this_run_usd": "0 (cached)" if cached else m["cost_unknown"]}
    if m.get("billing_note"):
        md["billing_note"] = m["billing_note"]
    return md


def local_quantization_key(q) -> dict:
    """The student's quantization settings as they key local answers, ``compute_dtype`` resolved for this host
    (``<device kind>:<dtype>``: the models load where ``LocalGenerator`` puts them), never ``auto``."""
    from campaign_orchestrator.hardware import key_precision

    return q.model_dump() | {"compute_dtype": key_precision(q.compute_dtype)}


def local_device() -> str:
    """Where local evaluation runs ("cuda" where torch sees a GPU, else "cpu"): it is billed at the hardware used
    (``training.hardware``; without a GPU a GPU entry is refused unless ``training.allow_cpu_fallback``)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_harness(spec: CampaignSpec, harness: list, adapter: dict, base, isd, context, progress):
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
        harness, harness_models(spec, adapter, base), isd.ensure() / "lm_eval", log=context.log.info, progress=progress
    )


def ray_device(spec: CampaignSpec) -> str:
    """Where the models answer on a KubeRay cluster: the Ray workers' device ("cuda" with GPUs per replica)."""
    return "cuda" if spec.execution.num_gpus_per_replica > 0 else "cpu"


def _generation_engine(spec: CampaignSpec, log):
    """The Ray session the evaluation's models answer in (``execution.engine: ray`` here), else nothing (a KubeRay
    RayJob per model brings its own cluster)."""
    from contextlib import nullcontext

    if spec.execution.engine != "ray" or spec.execution.kuberay is not None:
        return nullcontext()
    from campaign_orchestrator.generation.scaleout.pool import ray_session

    return ray_session(spec.execution.ray_address, log=log)


def _ray_answers(
    spec: CampaignSpec,
    storage: ArtifactStore,
    role: str,
    base,
    adapter: dict | None,
    four_bit: bool,
    bs: int,
    log,
    dtypes: dict | None,
    launch=None,
    budget=None,
):
    """A ``generate(prompts, max_new_tokens)`` answering on the stage's Ray actor pool, through the generation
    cache under the model's identity (base weights, adapter content, resolved quantization); a KubeRay RayJob per
    model and answer length through ``launch`` when the campaign sets ``execution.kuberay`` (``budget``: the stage's
    guard, checked while it runs)."""
    from assets.ray_dispatch import ray_runner
    from campaign_orchestrator.generation.recipes import GeneratorRecipe
    from campaign_orchestrator.generation.requests import namespace
    from campaign_orchestrator.generation.scaleout.job import AnswerRecipe
    from campaign_orchestrator.generation.scaleout.stage import answers_on_ray
    from campaign_orchestrator.generation.scaleout.worker import CacheConfig

    s, q = spec.student, spec.student.quantization
    adapter_dir = adapter["adapter_path"] if adapter else None
    identity, _precision = answer_identity(spec, base, adapter)
    recipe = AnswerRecipe(
        GeneratorRecipe(str(base), str(adapter_dir) if adapter_dir else None, four_bit, q.compute_dtype, batch_size=bs),
        identity,
        model=f"{s.base_model} ({role})",
    )

    def cache_for(sampling):
        return CacheConfig(
            storage.cache_store().url,
            namespace(identity, sampling),
            str(storage.spool_dir()),
            storage.s3_endpoint_url,
            storage.s3_region,
        )

    def generate(prompts, max_new_tokens):
        kuberay = spec.execution.kuberay is not None
        run_on = ray_runner(spec, launch and launch.at(f"{role}@{max_new_tokens}"), "answers")
        outs, run, st = answers_on_ray(
            spec.execution,
            prompts,
            recipe,
            identity,
            max_new_tokens,
            cache_for,
            log=log,
            label=f"{role} answers",
            run=run_on,
            **({"budget": budget} if kuberay else {}),
        )
        if dtypes is not None and st.compute_dtype:
            dtypes[role] = st.compute_dtype
        if dtypes is not None:  # answers generated/cached; shards done/total per model (the manifest's ray_shards)
            tally(dtypes.setdefault("_answers", {}), role, st)
            dtypes.setdefault("_ray", {})[f"{role}@{max_new_tokens}"] = f"{run.done}/{len(run.shards)}"
        return outs

    return generate


def _models(
    spec: CampaignSpec,
    adapter: dict,
    base,
    context,
    dtypes: dict | None = None,
    storage: ArtifactStore | None = None,
    launch=None,
    budget=None,
) -> dict:
    """role -> factory of a ``generate(prompts, max_new_tokens)`` callable (loaded when called) for the
    candidate and the base (the teacher is asked through its backend: ``teacher_scorer``); ``dtypes``
    collects each local model's resolved compute dtype. With ``execution.engine: ray`` the local models answer
    on the stage's Ray actor pool (``storage``: where their answers are cached), in a KubeRay RayJob through
    ``launch`` with ``execution.kuberay``."""
    ev, q = spec.evaluation, spec.student.quantization
    if ev.backend == "openai":
        return _endpoint_models(spec, adapter, context)
    from campaign_orchestrator.generation.backends import TransformersBackend
    from campaign_orchestrator.generation.cache import GenerationCache
    from campaign_orchestrator.generation.requests import namespace
    from campaign_orchestrator.generation.runner import cached_answers

    s = spec.student
    bs = max(x.batch_size for x in ev.suites)
    if spec.execution.engine == "ray" and storage is not None:
        log = context.log.info
        return {
            "candidate": lambda: _ray_answers(
                spec, storage, "candidate", base, adapter, q.load_in_4bit, bs, log, dtypes, launch, budget
            ),
            "base": lambda: _ray_answers(
                spec, storage, "base", base, None, q.load_in_4bit, bs, log, dtypes, launch, budget
            ),
        }

    def local(role, adapter_dir=None):
        """The model answers through the generation cache under its content identity (:func:`answer_identity`):
        loaded only when some item is not there yet."""
        identity, precision = answer_identity(spec, base, adapter if adapter_dir else None)

        def on_stats(st):
            if dtypes is not None:
                dtypes[role] = st.compute_dtype or precision.split(":", 1)[1]
                tally(dtypes.setdefault("_answers", {}), role, st)

        def cache_for(sampling):
            return GenerationCache(storage.cache_store(), namespace(identity, sampling), storage.spool_dir())

        def factory():  # the backend (and the model it loads) lives while its role answers, then goes
            backend = TransformersBackend(
                base,
                f"{s.base_model} ({role})",
                identity,
                batch_size=bs,
                compute_dtype=q.compute_dtype,
                precision=precision,
                adapter_dir=adapter_dir,
                load_in_4bit=q.load_in_4bit,
            )
            return cached_answers(backend, cache_for, log=context.log.info, on_stats=on_stats)

        return factory

    return {"candidate": local("candidate", adapter["adapter_path"]), "base": local("base")}


def _endpoint_models(spec: CampaignSpec, adapter: dict, context) -> dict:
    """Candidate and base through the campaign's OpenAI-compatible endpoint (``evaluation.endpoint``), after
    checking it serves exactly the candidate's adapter (loading it first with ``load_adapter``)."""
    from dagster import Failure

    from evaluation.endpoint import AdapterNotVerified, OpenAIEndpoint

    ev = spec.evaluation
    e = ev.endpoint
    cand_name = e.candidate_model
    ep = OpenAIEndpoint(e.base_url, cand_name or "", api_key_env=e.api_key_env, timeout_s=e.timeout_s)
    if e.load_adapter:
        cand_name = f"{spec.name}-{adapter['key']}"
        ep.load_adapter(cand_name, adapter["adapter_path"])
        context.log.info(f"loaded adapter {adapter['adapter_path']} into {e.base_url} as {cand_name}")
    try:  # no score is credited to this candidate unless the server serves exactly its adapter
        checked = ep.verify_adapter(cand_name, adapter["adapter_path"])
    except AdapterNotVerified as err:
        raise Failure(str(err), allow_retries=False) from None
    context.log.info(
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


def answer_identity(spec: CampaignSpec, base, adapter: dict | None) -> tuple[str, str]:
    """``(identity, precision)`` under which the student's base (``adapter`` None) or a candidate caches its
    answers: its weights, the compute dtype resolved for where it runs (``<device kind>:<dtype>``), the adapter's
    content key, its 4-bit settings. The base's is a ``transformers`` teacher's identity over the same weights and
    precision, so a context-distillation teacher's bare-prompt answers are the base's (answered once)."""
    from campaign_orchestrator.generation.backends import answer_identity as identity_of

    s, q = spec.student, spec.student.quantization
    precision = local_quantization_key(q)["compute_dtype"]
    return identity_of(
        s.base_model,
        base,
        s.revision,
        weights_id=model_identity(base, s.revision),
        precision=precision,
        adapter_id=adapter["key"] if adapter else None,
        quantization=q.model_dump() if q.load_in_4bit else None,
    ), precision
