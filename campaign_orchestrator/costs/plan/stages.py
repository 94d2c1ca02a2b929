"""Each stage's estimate: teacher generations, the student's training (with on-policy distillation's own work),
the sweep and evaluation. Every estimate has the time, the billed quantity and the dollars at one price entry;
``usd`` None (with ``unknown`` saying why) where the teacher's price is ``unpriced``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from campaign_orchestrator.costs.catalog import Catalog, PriceEntry
from campaign_orchestrator.costs.memory import DTYPE_BYTES, ModelShape, PlanError
from campaign_orchestrator.costs.plan.facts import DataFacts, teacher_answers_as_base
from campaign_orchestrator.costs.plan.roofline import (
    compute_dtype_on,
    decode_length,
    generation_seconds,
    hours_usd,
    packed_rows,
    peak_flops,
    perf,
)
from campaigns.spec import CampaignSpec

UNPRICED = "teacher.price is `unpriced`"


@dataclass(kw_only=True)
class StageEstimate:
    """What every stage's estimate has: seconds (None: an API's, not estimated), the price entry, its unit, the
    billed quantity in it, the dollars (None: unknown, ``unknown`` says why)."""

    seconds: float | None
    price_key: str
    unit: str
    quantity: float
    usd: float | None
    unknown: str | None = None


@dataclass(kw_only=True)
class TeacherEstimate(StageEstimate):
    """``requests`` teacher answers (``teacher_generations``, or scoring the teacher in evaluation)."""

    requests: int
    prompt_tokens: float
    completion_tokens: float
    tokens: float
    compute_dtype: str | None = None  # a self-hosted teacher's


@dataclass(kw_only=True)
class OnPolicyEstimate:
    """On-policy distillation's work inside ``student_adapter`` (:func:`plan_on_policy`)."""

    on_policy_steps: int
    off_policy_steps: int
    samples: int
    rounds: int
    samples_per_round: int
    sampled_tokens: float
    sampling_seconds: float
    teacher_prefill_tokens: float
    scoring_seconds_in_process: float | None  # a self-hosted teacher scores on the training host
    teacher_price_key: str
    teacher_usd: float | None  # an API teacher's prefills (0 in process; None: unpriced)
    unknown: str | None = None
    training_host_usd: float | None = None  # the training host's share of the stage's dollars


@dataclass(kw_only=True)
class TrainingEstimate(StageEstimate):
    """``student_adapter``: steps, tokens and FLOPs on ``training.hardware``."""

    steps: int
    sequences: int
    tokens: float
    labelled_tokens: float
    flops: float
    compute_dtype: str
    peak_gflops: float
    startup_s: float  # one launch's share of ``seconds``
    on_policy: OnPolicyEstimate | None = None


@dataclass(kw_only=True)
class SweepEstimate(StageEstimate):
    """``hparam_sweep``: every rung's surviving trials (``SweepSpec.plan_rungs``)."""

    rungs: list[dict]
    trials: int
    steps: int
    every_trial_to_the_end_seconds: float
    cap_usd: float | None
    within_cap: bool | None


@dataclass(kw_only=True)
class EvaluationEstimate(StageEstimate):
    """``evaluation``: candidate and base (and the teacher when scored) answer every suite's items once."""

    items: int
    models: list[str]
    teacher_price_key: str | None = None
    teacher_usd: float | None = None
    teacher_items_from_base: int | None = None  # the teacher's bare-prompt answers that are the base's


def plan_stages(
    spec: CampaignSpec, catalog: Catalog, facts: DataFacts, teacher: ModelShape | None, student: ModelShape
) -> dict[str, StageEstimate]:
    """Every stage's estimate, in the graph's order (no ``teacher_generations`` when on-policy skips it)."""
    t, pl = spec.teacher, spec.cost.planner
    out: dict[str, StageEstimate] = {}
    # teacher_generations: priced by the teacher's one price field (costs.catalog.teacher_entry), as the
    # budget guard and the recorded cost are
    n_req = facts.train_prompts * t.sampling.n
    new_tok = t.sampling.max_new_tokens * pl.completion_fill
    if not spec.training.distillation.skips_teacher:  # else no teacher stage in the graph
        # local generation prefills a prefix every prompt shares (the teacher's context) once per call
        out["teacher_generations"] = teacher_estimate(
            spec,
            catalog,
            teacher,
            n_req,
            facts.prompt_tokens_teacher,
            new_tok,
            t.batch_size,
            facts.shared_prefix_tokens,
            decode_length(t.backend, t.sampling.temperature, t.sampling.max_new_tokens),
        )
    training = plan_training(spec, catalog, facts, teacher, student, n_req, new_tok)
    out["student_adapter"] = training
    # hparam_sweep: every rung's surviving trials × that rung's new steps (trials continue from their checkpoints),
    # one launch (startup) per trial per rung
    if spec.sweep is not None:
        entry = catalog.get(spec.training.hardware)
        startup = perf(entry, "train_startup_s")
        out["hparam_sweep"] = plan_sweep(spec, entry, (training.seconds - startup) / training.steps, startup)
    out["evaluation"] = plan_evaluation(spec, catalog, facts, teacher, student, training.compute_dtype)
    return out


def plan_training(
    spec: CampaignSpec,
    catalog: Catalog,
    facts: DataFacts,
    teacher: ModelShape | None,
    student: ModelShape,
    n_req: int,
    new_tok: float,
) -> TrainingEstimate:
    """``student_adapter``: every generation accepted (an upper bound), packed into rows, trained for
    ``max_steps`` (or ``epochs``) on ``training.hardware``; on-policy distillation's sampling and scoring added."""
    c, tr, pl = spec.cost, spec.training, spec.cost.planner
    seq, rows = packed_rows(spec, facts.prompt_tokens_student, new_tok, n_req)  # every generation accepted
    rows_per_step = tr.micro_batch_size * tr.world_size * tr.gradient_accumulation_steps
    steps = tr.max_steps if tr.max_steps is not None else max(1, math.ceil(tr.epochs * rows / rows_per_step))
    tokens = steps * rows_per_step * seq
    ckpt = tr.activation_checkpointing in (True, "full")
    # the decoder at every position (MoE: a token passes k of E experts), the LM head only where a label is
    # (training.head: a prompt position needs no logits); embeddings are a lookup
    head = student.vocab * student.hidden
    body = student.active_params - head * (1 if student.tied else 2)
    labelled = tokens * min(1.0, (new_tok + 1) / max(1.0, facts.prompt_tokens_student + new_tok + 1))
    flops = (6 if ckpt else 4) * body * tokens + 4 * head * labelled
    entry = catalog.get(tr.hardware)
    if not entry.hourly:
        raise PlanError(f"training.hardware {tr.hardware!r} is priced per {entry.unit}; training needs hourly hardware")
    sdt = compute_dtype_on(spec.student.quantization.compute_dtype, entry)
    seconds = (
        flops / (tr.world_size * peak_flops(entry, sdt) * pl.mfu)
        + steps * perf(entry, "step_overhead_s")
        + perf(entry, "train_startup_s")
    )
    on_policy = None
    if tr.distillation.loss == "on_policy":  # the student samples, the teacher scores: time and money of their own
        on_policy = plan_on_policy(spec, catalog, facts, teacher, student, entry, steps, rows_per_step, sdt)
        seconds += on_policy.sampling_seconds + (on_policy.scoring_seconds_in_process or 0.0)
    qty, usd = hours_usd(entry, seconds, tr.nodes, tr.world_size, c.pricing_tier)
    est = TrainingEstimate(
        steps=steps,
        sequences=steps * rows_per_step,
        tokens=tokens,
        labelled_tokens=labelled,
        flops=flops,
        seconds=seconds,
        price_key=entry.key,
        unit=entry.unit,
        quantity=qty,
        usd=usd,
        compute_dtype=sdt,
        peak_gflops=peak_flops(entry, sdt) / 1e9,
        startup_s=perf(entry, "train_startup_s"),
        on_policy=on_policy,
    )
    if on_policy is not None:
        on_policy.training_host_usd = usd
        if on_policy.teacher_usd is None:
            est.usd, est.unknown = None, on_policy.unknown
        else:
            est.usd = usd + on_policy.teacher_usd
    return est


def plan_evaluation(
    spec: CampaignSpec, catalog: Catalog, facts: DataFacts, teacher: ModelShape | None, student: ModelShape, sdt: str
) -> EvaluationEstimate:
    """``evaluation``: candidate and base (and the teacher, whatever its backend) answer every held-out item once
    per suite; local models on the training hardware, the teacher at its own price."""
    c, t, pl, ev = spec.cost, spec.teacher, spec.cost.planner, spec.evaluation
    entry = catalog.get(spec.training.hardware)
    roles = ["candidate", "base"]
    seconds = 0.0
    for _role in roles:
        for suite in ev.suites:
            n_items, p_tok = facts.suites[suite.name]
            seconds += generation_seconds(
                student.active_params,
                student.params * DTYPE_BYTES[sdt],
                n_items,
                p_tok,
                suite.max_new_tokens * pl.completion_fill,
                suite.batch_size,
                entry,
                pl.generation_mfu,
                sdt,
                decode_length("transformers", 0.0, suite.max_new_tokens),
            )
    qty, usd = hours_usd(entry, seconds, 1, 1, c.pricing_tier)
    est = EvaluationEstimate(
        items=sum(n for n, _ in facts.suites.values()),
        models=roles,
        seconds=seconds,
        price_key=entry.key,
        unit=entry.unit,
        quantity=qty,
        usd=usd,
    )
    if not ev.score_teacher:
        return est
    scoring = []
    # a teacher over the base's weights asks its bare prompts as the base did: those answers are the base's
    as_base = teacher_answers_as_base(spec)
    for suite in ev.suites:  # asked as it answered the training prompts: with its context, a shared prefix
        n_items, p_tok = facts.suites[suite.name]
        if as_base:
            n_items = round(n_items * facts.suite_context_share.get(suite.name, 1.0))
        p_tok += facts.template_tokens_teacher - facts.template_tokens_student
        scoring.append(
            teacher_estimate(
                spec,
                catalog,
                teacher,
                n_items,
                p_tok,
                suite.max_new_tokens * pl.completion_fill,
                t.batch_size,
                facts.shared_prefix_tokens,
                decode_length(t.backend, 0.0, suite.max_new_tokens),
            )
        )
    teacher_usd = None if any(x.usd is None for x in scoring) else sum(x.usd for x in scoring)
    est.models = [*roles, "teacher"]
    est.teacher_price_key, est.teacher_usd = scoring[0].price_key, teacher_usd
    est.usd = None if teacher_usd is None else usd + teacher_usd
    if all(x.seconds is not None for x in scoring):  # a local teacher's time is part of the stage's
        est.seconds = seconds + sum(x.seconds for x in scoring)
    if teacher_usd is None:
        est.unknown = scoring[0].unknown
    if as_base:
        est.teacher_items_from_base = sum(facts.suites[x.name][0] for x in ev.suites) - sum(x.requests for x in scoring)
    return est


def plan_on_policy(
    spec: CampaignSpec,
    catalog: Catalog,
    facts: DataFacts,
    teacher: ModelShape | None,
    student: ModelShape,
    entry: PriceEntry,
    steps: int,
    rows_per_step: int,
    dtype: str,
) -> OnPolicyEstimate:
    """On-policy training's own work (``training.distillation.loss: on_policy``), inside ``student_adapter``:

    - student sampling: ``lambda`` x the steps after the off-policy warm start, one sample per row of each such
      step, in rounds of ``samples_per_round`` (each rank decodes its share, a round as one batch, up to
      ``max_new_tokens``; the mean sample is ``completion_fill`` of it): training-host time;
    - teacher scoring: one prefill per sample (the teacher's rendered prompt, its context included, + the
      sample). An API teacher (``teacher.price``) bills those tokens at its *input* price (plus the one output
      token per sample vLLM generates); a self-hosted teacher scores in process on the training host: roofline
      prefill time (the context shared by a round's prompts prefilled once per round), billed with the training
      (``scoring_seconds_in_process``)."""
    from campaign_orchestrator.costs.catalog import on_policy_scoring_lines

    op, tr, pl, t = spec.training.distillation.on_policy, spec.training, spec.cost.planner, spec.teacher
    warm = op.warmup_steps if op.warmup == "sequence_kd" else 0
    on_steps = max(0, math.ceil((steps - warm) * op.lambda_)) if steps > warm else 0
    samples = on_steps * rows_per_step
    rounds = math.ceil(samples / op.samples_per_round) if samples else 0
    new_tok = op.max_new_tokens * pl.completion_fill
    world = tr.world_size
    per_rank = math.ceil(samples / world)
    sampling = 0.0
    if per_rank:
        sampling = generation_seconds(
            student.active_params,
            student.params * DTYPE_BYTES[dtype],
            per_rank,
            facts.prompt_tokens_student,
            new_tok,
            max(1, op.samples_per_round // world),
            entry,
            pl.generation_mfu,
            dtype,
            op.max_new_tokens,
        ) - perf(entry, "generate_startup_s")  # the student is loaded already
    # the teacher's prompt: its context only before the prompts of teacher.context_categories
    t_prompt = facts.prompt_tokens_student + facts.context_share * (
        facts.prompt_tokens_teacher - facts.prompt_tokens_student
    )
    prefill = samples * (t_prompt + new_tok)
    out = OnPolicyEstimate(
        on_policy_steps=on_steps,
        off_policy_steps=steps - on_steps,
        samples=samples,
        rounds=rounds,
        samples_per_round=op.samples_per_round,
        sampled_tokens=samples * new_tok,
        sampling_seconds=sampling,
        teacher_prefill_tokens=prefill,
        scoring_seconds_in_process=None,
        teacher_price_key=t.price_key or "unpriced",
        teacher_usd=0.0,
    )
    lines, _note = on_policy_scoring_lines(spec, catalog, int(round(prefill)), samples if t.api else 0)
    if lines is None:
        out.teacher_usd, out.unknown = None, UNPRICED
        return out
    if t.api:
        out.teacher_usd = float(sum(x["usd"] for x in lines))
        return out
    shape = teacher or student  # in process: the teacher's prefills on the training host, every rank its share
    tdt = compute_dtype_on(t.compute_dtype, entry)
    # in process, the context every prompt of a round shares is prefilled once per round
    shared = facts.shared_prefix_tokens * facts.context_share
    computed = max(0.0, prefill - shared * max(0, samples - rounds))
    out.scoring_seconds_in_process = 2 * shape.active_params * computed / (world * peak_flops(entry, tdt) * pl.mfu)
    return out


def plan_sweep(spec: CampaignSpec, entry: PriceEntry, step_s: float, startup_s: float) -> SweepEstimate:
    """The sweep's estimate: the sum over rungs of surviving trials × (that rung's new steps × seconds per step +
    one launch); trials are never pruned early by the estimate, so it is what successive halving spends at most
    when every rung keeps its full share (``SweepSpec.plan_rungs``)."""
    tr, c = spec.training, spec.cost
    rungs = spec.sweep.plan_rungs(tr.max_steps)
    seconds = sum(r["trials"] * (r["new_steps"] * step_s + startup_s) for r in rungs)
    qty, usd = hours_usd(entry, seconds, tr.nodes, tr.world_size, c.pricing_tier)
    full = spec.sweep.trials * (tr.max_steps * step_s + startup_s)
    return SweepEstimate(
        rungs=rungs,
        trials=spec.sweep.trials,
        steps=sum(r["trials"] * r["new_steps"] for r in rungs),
        seconds=seconds,
        every_trial_to_the_end_seconds=full,
        price_key=entry.key,
        unit=entry.unit,
        quantity=qty,
        usd=usd,
        cap_usd=spec.sweep.budget_usd,
        within_cap=None if spec.sweep.budget_usd is None else usd <= spec.sweep.budget_usd,
    )


def sweep_cap_problems(spec: CampaignSpec, catalog: Catalog) -> list[str]:
    """A sweep cap below the cheapest possible rung (one trial, ``min_steps`` steps, one launch, at the catalog's
    step overhead and start-up time alone: no FLOPs counted) can never run a trial."""
    sw = spec.sweep
    if sw is None or sw.budget_usd is None:
        return []
    entry = catalog.get(spec.training.hardware)
    if not entry.hourly:
        return []
    try:
        seconds = perf(entry, "train_startup_s") + sw.rungs.min_steps * perf(entry, "step_overhead_s")
    except PlanError:
        return []
    _qty, usd = hours_usd(entry, seconds, spec.training.nodes, spec.training.world_size, spec.cost.pricing_tier)
    if sw.budget_usd < usd:
        return [
            f"sweep.budget_usd ${sw.budget_usd:g} is below the cost of one rung: one trial's first "
            f"{sw.rungs.min_steps} steps on {entry.key} cost at least ${usd:.6f} (start-up "
            f"{perf(entry, 'train_startup_s'):g} s + {sw.rungs.min_steps} × {perf(entry, 'step_overhead_s'):g} s "
            f"step overhead); raise the cap or lower sweep.rungs.min_steps"
        ]
    return []


def teacher_estimate(
    spec: CampaignSpec,
    catalog: Catalog,
    teacher: ModelShape | None,
    requests: int,
    prompt_tokens: float,
    new_tokens: float,
    batch_size: int,
    shared_prefix: float = 0.0,
    decode_tokens: float | None = None,
) -> TeacherEstimate:
    """Tokens, time and money of ``requests`` teacher answers, at the teacher's one price: tokens x
    ``teacher.price`` for an API, roofline time x ``teacher.hardware`` (x tensor_parallel_size) for a
    self-hosted teacher, in the dtype it resolves to, prefilling ``shared_prefix`` tokens (its context) once
    per call; ``usd`` None (``unknown``) for ``price: unpriced``."""
    from campaign_orchestrator.costs.catalog import teacher_entry

    t, c, pl = spec.teacher, spec.cost, spec.cost.planner
    p_tok, c_tok = requests * prompt_tokens, requests * new_tokens
    tokens = {"requests": requests, "prompt_tokens": p_tok, "completion_tokens": c_tok, "tokens": p_tok + c_tok}
    entry = teacher_entry(spec, catalog)
    if entry is None:
        return TeacherEstimate(
            **tokens,
            price_key="unpriced",
            unit="million-tokens",
            seconds=None,
            quantity=(p_tok + c_tok) / 1e6,
            usd=None,
            unknown=UNPRICED,
        )
    if entry.hourly:
        if teacher is None:
            raise PlanError(
                f"teacher {t.model!r} runs on {entry.key} (teacher.hardware, hourly) but its config is not "
                "available to size it"
            )
        devices = t.tensor_parallel_size if t.backend == "vllm" else 1
        tdt = compute_dtype_on(t.compute_dtype, entry)
        p_eff = prompt_tokens - shared_prefix * (1 - 1 / max(requests, 1))
        seconds = generation_seconds(
            teacher.active_params,
            teacher.params * DTYPE_BYTES[tdt],
            requests,
            p_eff,
            new_tokens,
            batch_size,
            entry,
            pl.generation_mfu,
            tdt,
            decode_tokens,
        )
        qty, usd = hours_usd(entry, seconds, 1, devices, c.pricing_tier)
        return TeacherEstimate(
            **tokens, price_key=entry.key, unit=entry.unit, seconds=seconds, quantity=qty, usd=usd, compute_dtype=tdt
        )
    in_usd, out_usd = entry.token_usd(c.teacher_batch_api)
    return TeacherEstimate(
        **tokens,
        price_key=entry.key,
        unit=entry.unit,
        seconds=None,
        quantity=(p_tok + c_tok) / 1e6,
        usd=p_tok / 1e6 * in_usd + c_tok / 1e6 * out_usd,
    )
