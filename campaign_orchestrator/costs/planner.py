"""The planner: before anything runs, does the student fit its GPUs, and what will each stage cost?

Memory per device comes from :mod:`campaign_orchestrator.costs.memory` (ZeRO / FSDP model states, LoRA,
activations, logits). This module adds time and money.

Time: a roofline with fixed overheads, from the catalog's ``perf`` block of the hardware:
training FLOPs = 4·Ψ per token (forward 2Ψ, backward through a frozen base 2Ψ; +2Ψ when
activations are recomputed; Ψ the decoder's *active* parameters, those of a mixture of experts' k of E
experts), plus 4·V·h for the LM head at the labelled positions only (the trainer scores no prompt
position: ``training.head``), over ``world × peak × mfu``, plus ``step_overhead_s`` per optimizer
step and ``train_startup_s``. Generation = max(compute, weight reads per decode step over the
memory bandwidth) plus ``decode_step_overhead_s`` per decode step and ``generate_startup_s``; a
batch decodes to each answer's length where rows leave as they finish (vLLM; greedy local requests on the
continuous engine) and to its longest (``max_new_tokens``) where every row computes until the last one
stops (sampled local requests on ``generate``: :func:`decode_length`); the billed tokens and the training
examples count the mean answer (``completion_fill`` × ``max_new_tokens``).
The teacher is priced by its one price field (``costs.lines.teacher_entry``: ``teacher.price`` per
token for an API, which has no time estimate; ``teacher.hardware`` per hour for a self-hosted one), the
field the budget guard and the recorded cost read; ``price: unpriced`` makes every estimate that
depends on it ``None`` (shown "unknown").

Pure Python; reads model ``config.json`` and ``tokenizer.json`` with the ``tokenizers`` library.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from campaigns.spec import CampaignSpec
from campaign_orchestrator.costs.catalog import Catalog, PriceEntry, PricingError
from campaign_orchestrator.costs.memory import (  # noqa: F401  (PlanError, ModelShape: the planner's API)
    DTYPE_BYTES, GB, ModelShape, PlanError, moe_facts, training_memory, zero_table,
)

TOKEN_SAMPLE = 2000  # prompts tokenized to estimate the mean prompt length


# --------------------------------------------------------------------------- data


def _tokenizer(model_dir: Path | None):
    if model_dir is None or not (Path(model_dir) / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok.no_padding()  # a saved tokenizer may pad batches to a common length; we want true lengths
    tok.no_truncation()
    return tok


def _mean_tokens(tok, texts: list[str]) -> float:
    if not texts:
        return 0.0
    if tok is None:  # no tokenizer at hand (an API teacher): ~4 characters per token
        return sum(len(t) for t in texts) / len(texts) / 4
    return sum(len(e.ids) for e in tok.encode_batch(texts)) / len(texts)


def template_overhead(model_dir: Path | None, prompt: str, context: list[dict] | None = None) -> float:
    """Tokens the model's chat template (and a teacher's context messages) add around a prompt, measured by
    rendering it exactly as generation and training do (0 without a chat template)."""
    if model_dir is None or not prompt or not (Path(model_dir) / "tokenizer_config.json").exists():
        return 0.0
    from transformers import AutoTokenizer

    from campaign_orchestrator.dataset.formatting import FormatError, render_prompt_ids, tokenize_texts

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        rendered = render_prompt_ids(tok, [*(context or []), {"role": "user", "content": prompt}] if context else prompt)
    except FormatError:
        return 0.0
    return float(len(rendered) - len(tokenize_texts(tok, [prompt])[0]))


def suite_file_rows(spec: CampaignSpec) -> dict[str, list[dict]]:
    """The rows of every evaluation suite read from a file (not ``heldout``), read once for the plan."""
    from campaign_orchestrator.dataset.jsonl import jsonl_objects

    out = {}
    for s in spec.evaluation.suites:
        if s.source == "heldout":
            continue
        p = spec.path(s.source)
        if not p.exists():
            raise PlanError(f"evaluation suite {s.name!r}: source {s.source!r} not found at {p}")
        out[s.name] = [obj for _n, obj in jsonl_objects(p.read_text(encoding="utf-8"), p, PlanError)]
    return out


def suite_sizes(spec: CampaignSpec, files: dict[str, list[dict]], tok, held: int, held_tokens: float,
                overhead: float) -> dict[str, tuple[int, float]]:
    """Per suite: (items, mean prompt tokens as the student sees them): the held-out split, or the suite's file
    (``files``: :func:`suite_file_rows`)."""
    out = {}
    for s in spec.evaluation.suites:
        if s.source == "heldout":
            out[s.name] = (held, held_tokens)
            continue
        rows = files[s.name]
        out[s.name] = (len(rows), _mean_tokens(tok, [str(r.get("prompt", "")) for r in rows[:TOKEN_SAMPLE]]) + overhead)
    return out


def suite_context_shares(spec: CampaignSpec, held: list[dict], files: dict[str, list[dict]]) -> dict[str, float]:
    """Per suite: the share of its items the teacher is asked with its ``teacher.context`` (those of
    ``teacher.context_categories``; every item when that is unset, none without a context), as the evaluation
    stage asks it (item categories as :mod:`evaluation.suite` reads them: ``all`` when missing)."""
    t, out = spec.teacher, {}
    for s in spec.evaluation.suites:
        if not t.context or t.context_categories is None:
            out[s.name] = 1.0 if t.context else 0.0
            continue
        if s.source == "heldout":
            cats = [str(r.get("category") or "all") for r in held if r.get("reference") is not None]
        else:
            cats = [str(r.get("category", "all")) for r in files[s.name]]
        out[s.name] = sum(c in t.context_categories for c in cats) / len(cats) if cats else 0.0
    return out


def teacher_answers_as_base(spec: CampaignSpec) -> bool:
    """Whether the teacher's bare-prompt evaluation answers are the base's (found in the generation cache under
    the same key, :func:`campaign_orchestrator.generation.backends.answer_identity`): a ``transformers`` teacher over
    the student's base weights (same model and revision) in the same compute dtype, the base not 4-bit. The
    model fields are compared as written (no weights are hashed to plan): the same weights named two ways are
    planned as two models, an over-estimate."""
    t, s = spec.teacher, spec.student
    q = s.quantization
    return (t.backend == "transformers" and t.model == s.base_model and t.revision == s.revision
            and t.compute_dtype == q.compute_dtype and not q.load_in_4bit)


def data_facts(spec: CampaignSpec, repo_root: Path, teacher_dir: Path | None, student_dir: Path | None) -> dict:
    """Prompt counts after the held-out split and mean prompt lengths in each model's tokens."""
    from campaign_orchestrator.dataset import prompts as P

    d = spec.data
    rows = P.read_prompts(P.source_files(d.source, repo_root),
                          P.SourceFields(d.id_field, d.prompt_field, d.reference_field, d.category_field))
    train, held = P.split(rows, d.heldout.fraction, d.heldout.seed, d.heldout.max_items)
    sample = [r["prompt"] for r in train[:TOKEN_SAMPLE]]
    held_sample = [r["prompt"] for r in held[:TOKEN_SAMPLE]]
    t_tok, s_tok = _tokenizer(teacher_dir), _tokenizer(student_dir)
    first = sample[0] if sample else ""
    ctx = [m.model_dump() for m in spec.teacher.context]
    t_over = template_overhead(teacher_dir, first, ctx) if spec.teacher.backend == "transformers" else 0.0
    s_over = template_overhead(student_dir, first)
    files = suite_file_rows(spec)
    return {"train_prompts": len(train), "heldout_items": len(held),
            "prompt_tokens_teacher": _mean_tokens(t_tok, sample) + t_over,
            "prompt_tokens_student": _mean_tokens(s_tok, sample) + s_over,
            "heldout_prompt_tokens_student": _mean_tokens(s_tok, held_sample) + s_over,
            "heldout_prompt_tokens_teacher": _mean_tokens(t_tok, held_sample) + t_over,
            "template_tokens": {"teacher": t_over, "student": s_over},
            # the share of training prompts the teacher is asked with its context (teacher.context_categories)
            "context_share": (sum(r.get("category") in spec.teacher.context_categories for r in train) / len(train)
                              if spec.teacher.context_categories is not None and train else 1.0),
            "shared_prefix_tokens": max(0.0, t_over - s_over),
            "suites": suite_sizes(spec, files, s_tok, len(held), _mean_tokens(s_tok, held_sample) + s_over, s_over),
            "suite_context_share": suite_context_shares(spec, held, files),
            "tokenizer": "model tokenizer" if t_tok is not None else "~4 characters per token"}


# --------------------------------------------------------------------------- time and money


def compute_dtype_on(spec_dtype: str, entry: PriceEntry) -> str:
    """The dtype a stage on ``entry`` computes in: ``auto`` resolved as the trainer resolves it (on a host
    with ``host_measured_peak``: this host's measurement; on a GPU entry: bf16)."""
    if entry.perf.get("host_measured_peak"):
        from campaign_orchestrator.hardware import resolve_compute_dtype

        return resolve_compute_dtype(spec_dtype, "cpu").dtype
    return "bfloat16" if spec_dtype == "auto" else spec_dtype


def peak_flops(entry: PriceEntry, dtype: str) -> float:
    """FLOP/s of one device of ``entry`` in ``dtype``: this host's measured matmul peak where the entry asks
    for it, else the catalog's figure (fp32: ``fp32_peak_tflops``, else a quarter of the bf16 peak)."""
    if entry.perf.get("host_measured_peak"):
        from campaign_orchestrator.hardware import measure_cpu_peak

        return measure_cpu_peak().gflops(dtype) * 1e9
    if dtype == "float32":
        return float(entry.perf.get("fp32_peak_tflops") or _perf(entry, "peak_tflops") / 4) * 1e12
    return _perf(entry, "peak_tflops") * 1e12


def _perf(entry: PriceEntry, key: str) -> float:
    try:
        return float(entry.perf[key])
    except KeyError:
        raise PlanError(f"pricing catalog entry {entry.key!r} has no perf.{key}; add it to plan stages on this "
                        "hardware") from None


def generation_seconds(params: int, weight_bytes: float, prompts: int, prompt_tokens: float, new_tokens: float,
                       batch_size: int, entry: PriceEntry, mfu: float, dtype: str = "bfloat16",
                       decode_tokens: float | None = None) -> float:
    """Roofline time to answer ``prompts`` prompts on one device (see the module docstring): ``new_tokens`` is
    the mean answer's length, ``decode_tokens`` (default: the same) the length a batch decodes to, which its
    longest answer sets on ``generate`` (every row of the batch computes until the last one stops: see
    :func:`decode_length`)."""
    if not prompts:
        return 0.0  # nothing to answer: no model is loaded
    batches = math.ceil(prompts / batch_size)
    decoded = new_tokens if decode_tokens is None else max(new_tokens, decode_tokens)
    flops = 2 * params * prompts * (prompt_tokens + decoded)
    compute = flops / (peak_flops(entry, dtype) * mfu)
    decode_steps = batches * decoded
    memory = decode_steps * weight_bytes / (_perf(entry, "memory_bandwidth_gbps") * 1e9)
    return max(compute, memory) + decode_steps * _perf(entry, "decode_step_overhead_s") + _perf(entry, "generate_startup_s")


def decode_length(backend: str, temperature: float, max_new_tokens: int) -> int | None:
    """What a batch decodes to (:func:`generation_seconds`' ``decode_tokens``): None (each answer its own length)
    where rows leave the batch as they finish: vLLM (continuous batching) and greedy local requests (the
    ``transformers`` backend's continuous engine, ``auto``'s choice in every dtype); ``max_new_tokens`` for sampled
    local requests, which ``generate`` decodes until the batch's longest answer ends. (The measurement switch
    ``$CAMPAIGN_GENERATION_ENGINE=hf_generate`` is not planned for.)"""
    return max_new_tokens if backend == "transformers" and temperature > 0 else None


PACKING_FILL = 0.95  # share of a packed row's max_seq_len best-fit-decreasing fills with short examples (measured)


def packed_rows(spec: CampaignSpec, facts: dict, new_tokens: float, examples: float) -> tuple[float, float]:
    """(tokens per training row, rows): an example is its rendered prompt, its completion and the stop token;
    with ``dataset.packing`` rows hold several examples, up to ``max_seq_len``."""
    tr = spec.training
    example = min(tr.max_seq_len, facts["prompt_tokens_student"] + new_tokens + 1)
    if not spec.dataset.packing or example >= tr.max_seq_len * PACKING_FILL:
        return example, examples
    row = tr.max_seq_len * PACKING_FILL
    return row, max(1.0, math.ceil(examples * example / row))


def _hours_usd(entry: PriceEntry, seconds: float, hosts: int, devices: int, tier: str) -> tuple[float, float]:
    qty = seconds / 3600 * (hosts if entry.unit == "host-hour" else devices)
    return qty, qty * entry.hourly_usd(tier)


def plan_stages(spec: CampaignSpec, catalog: Catalog, facts: dict, teacher: ModelShape | None,
                student: ModelShape) -> dict[str, dict]:
    c, t, tr, pl = spec.cost, spec.teacher, spec.training, spec.cost.planner
    out: dict[str, dict] = {}

    # teacher_generations: priced by the teacher's one price field (costs.lines.teacher_entry), as the
    # budget guard and the recorded cost are
    n_req = facts["train_prompts"] * t.sampling.n
    new_tok = t.sampling.max_new_tokens * pl.completion_fill
    # local generation prefills a prefix every prompt shares (the teacher's context) once per call
    out["teacher_generations"] = _teacher_estimate(spec, catalog, teacher, n_req, facts["prompt_tokens_teacher"],
                                                   new_tok, t.batch_size, facts.get("shared_prefix_tokens", 0.0),
                                                   decode_length(t.backend, t.sampling.temperature,
                                                                 t.sampling.max_new_tokens))

    # student_adapter
    seq, rows = packed_rows(spec, facts, new_tok, n_req)  # every generation accepted: an upper bound
    rows_per_step = tr.micro_batch_size * tr.world_size * tr.gradient_accumulation_steps
    steps = tr.max_steps if tr.max_steps is not None else max(1, math.ceil(tr.epochs * rows / rows_per_step))
    tokens = steps * rows_per_step * seq
    ckpt = bool(getattr(tr, "activation_checkpointing", False))
    # the decoder at every position (MoE: a token passes k of E experts), the LM head only where a label is
    # (training.head: a prompt position needs no logits); embeddings are a lookup
    head = student.vocab * student.hidden
    body = student.active_params - head * (1 if student.tied else 2)
    labelled = tokens * min(1.0, (new_tok + 1) / max(1.0, facts["prompt_tokens_student"] + new_tok + 1))
    flops = (6 if ckpt else 4) * body * tokens + 4 * head * labelled
    entry = catalog.get(tr.hardware)
    if not entry.hourly:
        raise PlanError(f"training.hardware {tr.hardware!r} is priced per {entry.unit}; training needs hourly hardware")
    sdt = compute_dtype_on(spec.student.quantization.compute_dtype, entry)
    seconds = (flops / (tr.world_size * peak_flops(entry, sdt) * pl.mfu)
               + steps * _perf(entry, "step_overhead_s") + _perf(entry, "train_startup_s"))
    on_policy = None
    if tr.distillation.loss == "on_policy":  # the student samples, the teacher scores: time and money of their own
        on_policy = plan_on_policy(spec, catalog, facts, teacher, student, entry, steps, rows_per_step, sdt)
        seconds += on_policy["sampling_seconds"] + (on_policy["scoring_seconds_in_process"] or 0.0)
        if spec.training.distillation.skips_teacher:
            out.pop("teacher_generations")  # no teacher stage in the graph
    qty, usd = _hours_usd(entry, seconds, tr.nodes, tr.world_size, c.pricing_tier)
    out["student_adapter"] = {"steps": steps, "sequences": steps * rows_per_step, "tokens": tokens,
                              "labelled_tokens": labelled, "flops": flops,
                              "seconds": seconds, "price_key": entry.key, "unit": entry.unit, "quantity": qty, "usd": usd,
                              "compute_dtype": sdt, "peak_gflops": peak_flops(entry, sdt) / 1e9,
                              "startup_s": _perf(entry, "train_startup_s")}  # one launch's share of ``seconds``
    if on_policy is not None:
        sa = out["student_adapter"]
        sa["on_policy"] = on_policy | {"training_host_usd": usd}
        if on_policy["teacher_usd"] is None:
            sa |= {"usd": None, "unknown": on_policy["unknown"]}
        else:
            sa["usd"] = usd + on_policy["teacher_usd"]

    # hparam_sweep: every rung's surviving trials × that rung's new steps (trials continue from their checkpoints),
    # one launch (startup) per trial per rung
    if spec.sweep is not None:
        out["hparam_sweep"] = plan_sweep(spec, entry, (seconds - _perf(entry, "train_startup_s")) / steps,
                                         _perf(entry, "train_startup_s"))

    # evaluation: candidate and base (and the teacher, whatever its backend) answer every held-out item once per
    # suite; local models on the training hardware, the teacher at its own price
    ev = spec.evaluation
    roles = [("candidate", student), ("base", student)]
    seconds = 0.0
    for _role, shape in roles:
        for suite in ev.suites:
            n_items, p_tok = facts["suites"][suite.name]
            if _role == "teacher":  # its context is a shared prefix, prefilled once per suite
                p_tok += (facts["template_tokens"]["teacher"] - facts["template_tokens"]["student"]
                          - facts.get("shared_prefix_tokens", 0.0) * (1 - 1 / max(n_items, 1)))
            seconds += generation_seconds(shape.active_params, shape.params * DTYPE_BYTES[sdt], n_items, p_tok,
                                          suite.max_new_tokens * pl.completion_fill, suite.batch_size, entry,
                                          pl.generation_mfu, sdt, decode_length("transformers", 0.0,
                                                                                suite.max_new_tokens))
    qty, usd = _hours_usd(entry, seconds, 1, 1, c.pricing_tier)
    est = {"items": sum(n for n, _ in facts["suites"].values()), "models": [r for r, _ in roles], "seconds": seconds,
           "price_key": entry.key, "unit": entry.unit, "quantity": qty, "usd": usd}
    if ev.score_teacher:
        scoring = []
        # a teacher over the base's weights asks its bare prompts as the base did: those answers are the base's
        as_base = teacher_answers_as_base(spec)
        shares = facts.get("suite_context_share", {})
        for suite in ev.suites:  # asked as it answered the training prompts: with its context, a shared prefix
            n_items, p_tok = facts["suites"][suite.name]
            if as_base:
                n_items = round(n_items * shares.get(suite.name, 1.0))
            p_tok += facts["template_tokens"]["teacher"] - facts["template_tokens"]["student"]
            scoring.append(_teacher_estimate(spec, catalog, teacher, n_items, p_tok,
                                             suite.max_new_tokens * pl.completion_fill, t.batch_size,
                                             facts.get("shared_prefix_tokens", 0.0),
                                             decode_length(t.backend, 0.0, suite.max_new_tokens)))
        teacher_usd = None if any(x["usd"] is None for x in scoring) else sum(x["usd"] for x in scoring)
        est |= {"models": est["models"] + ["teacher"], "teacher_price_key": scoring[0]["price_key"],
                "teacher_usd": teacher_usd, "usd": None if teacher_usd is None else usd + teacher_usd}
        if all(x["seconds"] is not None for x in scoring):  # a local teacher's time is part of the stage's
            est["seconds"] = seconds + sum(x["seconds"] for x in scoring)
        if teacher_usd is None:
            est["unknown"] = scoring[0]["unknown"]
        if as_base:
            est["teacher_items_from_base"] = sum(facts["suites"][x.name][0] for x in ev.suites) \
                - sum(x["requests"] for x in scoring)
    out["evaluation"] = est
    return out


def plan_on_policy(spec: CampaignSpec, catalog: Catalog, facts: dict, teacher: ModelShape | None,
                   student: ModelShape, entry: PriceEntry, steps: int, rows_per_step: int, dtype: str) -> dict:
    """On-policy training's own work (``training.distillation.loss: on_policy``), inside ``student_adapter``:

    - student sampling: ``lambda`` x the steps after the off-policy warm start, one sample per row of each such
      step, in rounds of ``samples_per_round`` (each rank decodes its share, a round as one batch, up to
      ``max_new_tokens``; the mean sample is ``completion_fill`` of it): training-host time;
    - teacher scoring: one prefill per sample (the teacher's rendered prompt, its context included, + the
      sample). An API teacher (``teacher.price``) bills those tokens at its *input* price (plus the one output
      token per sample vLLM generates); a self-hosted teacher scores in process on the training host: roofline
      prefill time (the context shared by a round's prompts prefilled once per round), billed with the training
      (``scoring_seconds_in_process``)."""
    op, tr, pl, c, t = spec.training.distillation.on_policy, spec.training, spec.cost.planner, spec.cost, spec.teacher
    warm = op.warmup_steps if op.warmup == "sequence_kd" else 0
    on_steps = max(0, math.ceil((steps - warm) * op.lambda_)) if steps > warm else 0
    samples = on_steps * rows_per_step
    rounds = math.ceil(samples / op.samples_per_round) if samples else 0
    new_tok = op.max_new_tokens * pl.completion_fill
    world = tr.world_size
    per_rank = math.ceil(samples / world)
    sampling = 0.0
    if per_rank:
        sampling = generation_seconds(student.active_params, student.params * DTYPE_BYTES[dtype], per_rank,
                                      facts["prompt_tokens_student"], new_tok, max(1, op.samples_per_round // world),
                                      entry, pl.generation_mfu, dtype, op.max_new_tokens) \
            - _perf(entry, "generate_startup_s")  # the student is loaded already
    # the teacher's prompt: its context only before the prompts of teacher.context_categories
    t_prompt = facts["prompt_tokens_student"] + facts.get("context_share", 1.0) * (
        facts["prompt_tokens_teacher"] - facts["prompt_tokens_student"])
    prefill = samples * (t_prompt + new_tok)
    out = {"on_policy_steps": on_steps, "off_policy_steps": steps - on_steps, "samples": samples, "rounds": rounds,
           "samples_per_round": op.samples_per_round, "sampled_tokens": samples * new_tok,
           "sampling_seconds": sampling, "teacher_prefill_tokens": prefill, "scoring_seconds_in_process": None,
           "teacher_price_key": t.price_key or "unpriced", "teacher_usd": 0.0}
    from campaign_orchestrator.costs.catalog import on_policy_scoring_lines

    lines, _note = on_policy_scoring_lines(spec, catalog, int(round(prefill)), samples if t.api else 0)
    if lines is None:
        return out | {"teacher_usd": None, "unknown": "teacher.price is `unpriced`"}
    if t.api:
        return out | {"teacher_usd": float(sum(x["usd"] for x in lines))}
    shape = teacher or student  # in process: the teacher's prefills on the training host, every rank its share
    tdt = compute_dtype_on(t.compute_dtype, entry)
    # in process, the context every prompt of a round shares is prefilled once per round
    shared = facts.get("shared_prefix_tokens", 0.0) * facts.get("context_share", 1.0)
    computed = max(0.0, prefill - shared * max(0, samples - rounds))
    flops = 2 * shape.active_params * computed
    return out | {"scoring_seconds_in_process": flops / (world * peak_flops(entry, tdt) * pl.mfu)}


def plan_sweep(spec: CampaignSpec, entry: PriceEntry, step_s: float, startup_s: float) -> dict:
    """The sweep's estimate: the sum over rungs of surviving trials × (that rung's new steps × seconds per step +
    one launch); trials are never pruned early by the estimate, so it is what successive halving spends at most
    when every rung keeps its full share (``SweepSpec.plan_rungs``)."""
    tr, c = spec.training, spec.cost
    rungs = spec.sweep.plan_rungs(tr.max_steps)
    seconds = sum(r["trials"] * (r["new_steps"] * step_s + startup_s) for r in rungs)
    qty, usd = _hours_usd(entry, seconds, tr.nodes, tr.world_size, c.pricing_tier)
    full = spec.sweep.trials * (tr.max_steps * step_s + startup_s)
    return {"rungs": rungs, "trials": spec.sweep.trials, "steps": sum(r["trials"] * r["new_steps"] for r in rungs),
            "seconds": seconds, "every_trial_to_the_end_seconds": full, "price_key": entry.key, "unit": entry.unit,
            "quantity": qty, "usd": usd, "cap_usd": spec.sweep.budget_usd,
            "within_cap": None if spec.sweep.budget_usd is None else usd <= spec.sweep.budget_usd}


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
        seconds = _perf(entry, "train_startup_s") + sw.rungs.min_steps * _perf(entry, "step_overhead_s")
    except PlanError:
        return []
    _qty, usd = _hours_usd(entry, seconds, spec.training.nodes, spec.training.world_size, spec.cost.pricing_tier)
    if sw.budget_usd < usd:
        return [f"sweep.budget_usd ${sw.budget_usd:g} is below the cost of one rung: one trial's first "
                f"{sw.rungs.min_steps} steps on {entry.key} cost at least ${usd:.6f} (start-up "
                f"{_perf(entry, 'train_startup_s'):g} s + {sw.rungs.min_steps} × {_perf(entry, 'step_overhead_s'):g} s "
                f"step overhead); raise the cap or lower sweep.rungs.min_steps"]
    return []


def _teacher_estimate(spec: CampaignSpec, catalog: Catalog, teacher: ModelShape | None, requests: int,
                      prompt_tokens: float, new_tokens: float, batch_size: int, shared_prefix: float = 0.0,
                      decode_tokens: float | None = None) -> dict:
    """Tokens, time and money of ``requests`` teacher answers, at the teacher's one price: tokens x
    ``teacher.price`` for an API, roofline time x ``teacher.hardware`` (x tensor_parallel_size) for a
    self-hosted teacher, in the dtype it resolves to, prefilling ``shared_prefix`` tokens (its context) once
    per call; ``usd`` None (``unknown``) for ``price: unpriced``."""
    from campaign_orchestrator.costs.lines import teacher_entry

    t, c, pl = spec.teacher, spec.cost, spec.cost.planner
    p_tok, c_tok = requests * prompt_tokens, requests * new_tokens
    st: dict = {"requests": requests, "prompt_tokens": p_tok, "completion_tokens": c_tok, "tokens": p_tok + c_tok}
    entry = teacher_entry(spec, catalog)
    if entry is None:
        return st | {"price_key": "unpriced", "unit": "million-tokens", "seconds": None, "quantity": (p_tok + c_tok) / 1e6,
                     "usd": None, "unknown": "teacher.price is `unpriced`"}
    st |= {"price_key": entry.key, "unit": entry.unit}
    if entry.hourly:
        if teacher is None:
            raise PlanError(f"teacher {t.model!r} runs on {entry.key} (teacher.hardware, hourly) but its config is not "
                            "available to size it")
        devices = t.tensor_parallel_size if t.backend == "vllm" else 1
        tdt = compute_dtype_on(t.compute_dtype, entry)
        p_eff = prompt_tokens - shared_prefix * (1 - 1 / max(requests, 1))
        seconds = generation_seconds(teacher.active_params, teacher.params * DTYPE_BYTES[tdt], requests, p_eff,
                                     new_tokens, batch_size, entry, pl.generation_mfu, tdt, decode_tokens)
        qty, usd = _hours_usd(entry, seconds, 1, devices, c.pricing_tier)
        return st | {"seconds": seconds, "quantity": qty, "usd": usd, "compute_dtype": tdt}
    in_usd, out_usd = entry.token_usd(c.teacher_batch_api)
    return st | {"seconds": None, "quantity": (p_tok + c_tok) / 1e6, "usd": p_tok / 1e6 * in_usd + c_tok / 1e6 * out_usd}


def heap_retention(entry: PriceEntry, spec: CampaignSpec) -> tuple[float, str]:
    """(share of activations + logits the C heap keeps resident, allocator): the local launcher starts
    training on jemalloc when this host has it (``campaign_orchestrator.allocator``), which keeps far less
    than glibc (catalog ``perf.heap_retention_jemalloc`` against ``perf.heap_retention``)."""
    if spec.training.launcher == "local" and "heap_retention_jemalloc" in entry.perf:
        from campaign_orchestrator import allocator

        try:
            if allocator.preload_env():
                return float(entry.perf["heap_retention_jemalloc"]), "jemalloc"
        except allocator.AllocatorError:
            pass
    return float(entry.perf.get("heap_retention", 0.0)), "glibc"


def plan_campaign(spec: CampaignSpec, catalog: Catalog, repo_root: Path, teacher_dir: Path | None,
                  student_dir: Path) -> dict:
    """The whole plan: data facts, per-device memory and fit, and per-stage estimates."""
    student = ModelShape.from_model_dir(student_dir)
    teacher = ModelShape.from_model_dir(teacher_dir) if teacher_dir is not None and (Path(teacher_dir) / "config.json").exists() else None
    facts = data_facts(spec, repo_root, teacher_dir, student_dir)
    pl = spec.cost.planner
    seq = int(math.ceil(packed_rows(spec, facts, spec.teacher.sampling.max_new_tokens * pl.completion_fill, 1)[0]))
    if spec.dataset.packing:
        seq = spec.training.max_seq_len  # the longest packed row sets the peak
    device = catalog.get(spec.training.hardware)
    attention = spec.student.attn_implementation
    if attention == "auto":  # as training.model.attention_kernel resolves it
        attention = "eager" if device.perf.get("host_measured_peak") and spec.training.max_seq_len <= 512 else "sdpa"
    sdt = compute_dtype_on(spec.student.quantization.compute_dtype, device)
    retention, alloc = heap_retention(device, spec)
    mem = training_memory(student, spec, seq, sdt, float(device.perf.get("runtime_gb", 0.0)), attention, retention)
    mem["allocator"] = alloc
    mem |= moe_facts(student, spec.student, DTYPE_BYTES[sdt])  # MoE: total vs active parameters, expert tensors
    ckpt = bool(getattr(spec.training, "activation_checkpointing", False))
    if device.memory_gb is not None:
        usable = device.memory_gb * pl.memory_headroom
        mem |= {"device": device.key, "device_memory_gb": device.memory_gb, "usable_gb": usable,
                "activation_checkpointing": ckpt,
                "fits": (mem["total_checkpointed_gb"] if ckpt else mem["total_gb"]) <= usable,
                "fits_with_checkpointing": mem["total_checkpointed_gb"] <= usable}
    stages = plan_stages(spec, catalog, facts, teacher, student)
    unknown = [f"{name}: {s['unknown']}" for name, s in stages.items() if s["usd"] is None]
    total = None if unknown else sum(s["usd"] for s in stages.values())  # never a silent $0 for what is unpriced
    budget = spec.cost.budget_usd
    plan = {"campaign": spec.name, "catalog": catalog.path, "catalog_version": catalog.version,
            "pricing_tier": spec.cost.pricing_tier, "data": facts,
            "student": asdict(student), "teacher": asdict(teacher) if teacher else None,
            "memory": mem, "stages": stages, "total_usd": total, "unknown": unknown, "budget_usd": budget,
            "within_budget": None if budget is None or total is None else total <= budget}
    if spec.execution.engine == "ray" and "teacher_generations" in stages:  # the teacher stage on 1..64 replicas
        plan["scaleout"] = plan_scaleout(spec, catalog, facts, teacher)
    return plan


def render_plan(plan: dict) -> str:
    """Plain-text plan for `campaign plan`."""
    m, d = plan["memory"], plan["data"]
    gb = m["per_device_gb"]
    catalog = Path(plan["catalog"])
    if catalog.is_absolute() and catalog.is_relative_to(Path.cwd()):
        catalog = catalog.relative_to(Path.cwd())
    lines = [f"plan for campaign {plan['campaign']} (catalog {catalog} version {plan['catalog_version']}, "
             f"{plan['pricing_tier'].replace('_', '-')} prices)", "",
             f"data: {d['train_prompts']} training prompts, {d['heldout_items']} held-out items; mean prompt "
             f"{d['prompt_tokens_teacher']:.1f} teacher / {d['prompt_tokens_student']:.1f} student tokens ({d['tokenizer']})", "",
             f"student memory per device: {m['params']:,} parameters ({m['weights']}), LoRA {m['lora_params']:,} trainable; "
             f"world {m['world_size']}, sharding {m['sharding']} (states sharded over {m['shard_group']}); "
             f"micro-batch {m['micro_batch']} × {m['seq_len']} tokens"]
    rows = [("process runtime (Python, torch, ...)", gb.get("runtime", 0.0)),
            (f"base weights ({m.get('compute_dtype', 'bfloat16')} compute)", gb["base_weights"]),
            ("LoRA weights", gb["lora_weights"]),
            ("LoRA gradients", gb["lora_gradients"]), ("optimizer states (Adam, K=12)", gb["optimizer_states"]),
            ("FSDP all-gather buffer", gb["allgather_buffer"]), ("activations", gb["activations"]),
            ("activations, checkpointed", gb["activations_checkpointed"]), ("logits + loss", gb["logits"]),
            ("heap kept by the C allocator (CPU)", gb.get("heap_retained", 0.0))]
    lines += [f"  {name:34s} {_gb(v)}" for name, v in rows]
    lines += _moe_lines(m)
    lines.append(f"  {'total (no checkpointing)':34s} {_gb(m['total_gb'])}")
    lines.append(f"  {'total (activation checkpointing)':34s} {_gb(m['total_checkpointed_gb'])}")
    if "device" in m:
        verdict = "fits" if m["fits"] else "does NOT fit"
        lines.append(f"  device {m['device']}: {m['device_memory_gb']:g} GB, {m['usable_gb']:.1f} GB usable → {verdict}"
                     + ("" if m["fits"] or not m["fits_with_checkpointing"] else " (fits with activation checkpointing)"))
    z = m["zero_full_finetune_gb"]
    lines += ["", f"full fine-tuning model states per device, for comparison (Ψ = {m['params']:,}, N = {m['world_size']}):",
              f"  ZeRO-0/DDP {_gb(z['zero0_ddp'])}  ZeRO-1 {_gb(z['zero1'])}  ZeRO-2 {_gb(z['zero2'])}  "
              f"ZeRO-3/FSDP {_gb(z['zero3_fsdp_full'])}  hybrid {_gb(z['fsdp_hybrid'])}", "",
              "estimated cost per stage:"]
    for name, s in plan["stages"].items():
        secs = "—" if s.get("seconds") is None else f"{s['seconds']:.0f} s"
        extra = (f"{s['tokens']:,.0f} teacher tokens" if name == "teacher_generations"
                 else f"{s['steps']} steps, {s['tokens']:,.0f} tokens" + _on_policy_text(s.get("on_policy"))
                 if name == "student_adapter"
                 else (f"{s['trials']} trials, rungs " + " → ".join(f"{r['trials']}×{r['steps']}" for r in s["rungs"])
                       + f", {s['steps']} steps" + (f", cap ${s['cap_usd']:g}" if s["cap_usd"] else ""))
                 if name == "hparam_sweep"
                 else f"{s['items']} items × {len(s['models'])} models"
                 + (f"; {s['teacher_items_from_base']} teacher answers are the base's"
                    if s.get("teacher_items_from_base") else ""))
        cost = "unknown" if s["usd"] is None else f"${s['usd']:.6f}"
        lines.append(f"  {name:20s} {secs:>9s}  {s['quantity']:.6f} {s['unit']:14s} {cost}   ({extra}, {s['price_key']})")
    total = "unknown" if plan["total_usd"] is None else f"${plan['total_usd']:.6f}"
    lines.append(f"  {'total':20s} {'':>9s}  {'':21s} {total}"
                 + (f"   ({'; '.join(plan['unknown'])})" if plan.get("unknown") else ""))
    if plan["budget_usd"] is not None:
        lines.append(f"budget ${plan['budget_usd']:.2f}: "
                     + ("within budget" if plan["within_budget"] else "the estimate EXCEEDS the budget"))
    if plan.get("scaleout"):
        lines += render_scaleout(plan["scaleout"])
    return "\n".join(lines)


def _on_policy_text(op: dict | None) -> str:
    """The student_adapter row's on-policy part: rounds, student sampling time, teacher prefills and their price."""
    if not op:
        return ""
    usd = "unknown" if op["teacher_usd"] is None else f"${op['teacher_usd']:.6f}"
    where = (f"in process, {op['scoring_seconds_in_process']:.0f} s on the training host"
             if op["scoring_seconds_in_process"] is not None else f"{usd} at {op['teacher_price_key']}")
    return (f"; on-policy: {op['rounds']} rounds, {op['samples']:,} student samples ({op['sampling_seconds']:.0f} s "
            f"sampling), teacher prefill {op['teacher_prefill_tokens']:,.0f} tokens ({where})")


def _moe_lines(m: dict) -> list[str]:
    e = m.get("moe")
    if not e:
        return []
    lora = (f"expert LoRA {e['expert_lora_params']:,} (rank {e['expert_rank']} per expert)" if e["expert_rank"]
            else "no expert LoRA")
    return [f"  mixture of experts: {e['experts']} experts, top-{e['experts_per_tok']}, {e['moe_layers']} MoE layers; "
            f"{e['total_params']:,} total / {e['active_params']:,} active parameters (memory from the total, FLOPs and "
            f"time from the active)",
            f"    expert tensors + routers {_gb(e['expert_weights_gb']).strip()} in the compute dtype (4-bit quantizes "
            f"nn.Linear only: the fused experts stay full precision); {lora}"
            + (f"; router trained ({e['router_trainable_params']:,})" if e["router_trainable_params"] else "")
            + (f"; folded expert copy {_gb(e['folded_expert_layer_gb']).strip()} per MoE layer (in the activations)"
               if e["folded_expert_layer_gb"] else "")]


def _gb(x: float) -> str:
    return f"{x:10.6f} GB" if x < 0.01 else f"{x:10.3f} GB"


def stage_estimate(plan: dict, stage: str) -> float:
    try:
        return float(plan["stages"][stage]["usd"])
    except KeyError:
        raise PricingError(f"the plan has no stage {stage!r}") from None


# --------------------------------------------------------------------------- scale-out (execution.engine: ray)


DEFAULT_REPLICAS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ScaleAssumptions:
    """What the replica table assumes beyond the catalog (every figure is printed with the table).

    ``cluster_start_s``: bring-up of the Ray cluster before the first shard; by default by where Ray runs
    (``cluster_start_for``): 60 s for a KubeRay cluster (pods scheduled, a GPU image pulled, Ray started), 5 s for
    a local one, 0 for an existing one (``execution.ray_address``). ``shard_overhead_s``: per shard, on its
    replica: scheduling, the cache look-up and the shard's Parquet write. ``first_token_s`` and
    ``stream_tokens_per_s``: an endpoint's latency (time to the first token, then output tokens per second of one
    request), used when the catalog entry of ``teacher.price`` has no ``perf.first_token_s`` /
    ``perf.stream_tokens_per_s``. ``knee_gain``: the knee is the fewest replicas at which doubling them would cut
    the stage's time by less than this fraction."""

    cluster_start_s: float | None = None
    shard_overhead_s: float = 0.5
    first_token_s: float = 0.5
    stream_tokens_per_s: float = 50.0
    knee_gain: float = 0.10

    def with_overrides(self, pairs: dict[str, float]) -> ScaleAssumptions:
        unknown = sorted(set(pairs) - set(asdict(self)))
        if unknown:
            raise PlanError(f"unknown scale-out assumption(s) {unknown}; known: {sorted(asdict(self))}")
        return ScaleAssumptions(**(asdict(self) | {k: float(v) for k, v in pairs.items()}))


CLUSTER_START_S = {"kuberay": 60.0, "local": 5.0, "existing": 0.0}


def cluster_start_for(spec: CampaignSpec) -> float:
    """The default ``cluster_start_s`` for where ``spec``'s Ray cluster comes from."""
    ex = spec.execution
    return CLUSTER_START_S["kuberay" if ex.kuberay is not None and not ex.kuberay.ray_cluster
                           else "existing" if ex.ray_address or ex.kuberay is not None else "local"]


def _knee(wall, max_replicas: int, gain: float) -> int:
    """The fewest replicas N at which doubling them cuts ``wall(N)`` by less than ``gain`` (searched up to
    ``max_replicas``, past which more replicas have nothing to do)."""
    n = 1
    while n < max_replicas:
        if wall(min(2 * n, max_replicas)) > (1 - gain) * wall(n):
            return n
        n += 1
    return max_replicas


def scale_self_hosted(*, requests: int, prompt_tokens: float, new_tokens: float, decode_tokens: float | None,
                      shard_prompts: int, batch_size: int, params: int, weight_bytes: float, entry: PriceEntry,
                      mfu: float, dtype: str, devices_per_replica: int, tier: str, replicas: list[int],
                      assume: ScaleAssumptions, one_host_slots: int | None = None) -> dict:
    """Time and money of ``requests`` generations on N self-hosted replicas (one model each), sharded.

    A shard of ``shard_prompts`` takes the roofline time of one replica (:func:`generation_seconds` without the
    start-up) plus ``shard_overhead_s``; N replicas run ``ceil(shards / N)`` rounds after the cluster's start-up
    and one model load (in parallel). A replica of ``devices_per_replica`` devices (tensor parallelism) is taken
    as ideal: each device computes and reads 1/devices of the model. Every replica is billed for the whole stage,
    its idle tail included, so more replicas than the knee cost more for little time.

    ``one_host_slots``: CPU replicas of a local cluster, sharing one host of ``entry`` (its peak is the whole
    host's): each replica gets 1/slots of it, at most ``slots`` run at once, and the one host is billed."""
    shards = max(1, math.ceil(requests / shard_prompts)) if requests else 0
    per_shard = min(shard_prompts, requests) if requests else 0
    load_s = _perf(entry, "generate_startup_s")
    slots = max(1, one_host_slots or 0)
    shard_s = (generation_seconds(params / devices_per_replica, weight_bytes / devices_per_replica, per_shard,
                                  prompt_tokens, new_tokens, batch_size, entry, mfu, dtype, decode_tokens)
               - load_s) * (slots if one_host_slots else 1) + assume.shard_overhead_s if shards else 0.0
    parallel = (lambda n: min(n, slots)) if one_host_slots else (lambda n: n)

    def wall(n: int) -> float:
        return assume.cluster_start_s + load_s + math.ceil(shards / parallel(n)) * shard_s if shards else 0.0

    one = wall(1)
    rows = []
    for n in replicas:
        seconds = wall(n)
        billed = 1 if one_host_slots else n
        _qty, usd = _hours_usd(entry, seconds, billed, billed * devices_per_replica, tier)
        bound = ("shards (replicas past the shard count idle)" if n > shards
                 else f"this host ({slots} replica(s) at once)" if one_host_slots and n > slots else "replicas")
        rows.append({"replicas": n, "seconds": seconds, "usd": usd, "speedup": one / seconds if seconds else 1.0,
                     "efficiency": (one / seconds / n) if seconds else 1.0, "bound": bound})
    useful = min(shards, slots) if one_host_slots else shards
    knee = _knee(wall, max(1, useful), assume.knee_gain)
    return {"kind": "self-hosted", "requests": requests, "shards": shards, "shard_prompts": shard_prompts,
            "shard_seconds": shard_s, "model_load_seconds": load_s, "devices_per_replica": devices_per_replica,
            "price_key": entry.key, "price_as_of": entry.as_of, "price_source": entry.source,
            "usd_per_device_hour": entry.hourly_usd(tier), "rows": rows, "knee_replicas": knee,
            "max_useful_replicas": useful, "ceiling": None, "one_host_slots": one_host_slots,
            "why_more_stop_helping": (f"past {knee} replica(s) a doubling cuts the time by less than "
                                      f"{assume.knee_gain:.0%}: "
                                      + (f"this host runs {slots} replica(s) at once (its CPUs)"
                                         if one_host_slots and knee >= useful else
                                         f"the fixed start-up ({assume.cluster_start_s + load_s:.0f} s) dominates "
                                         f"the {shards} shard(s) of {shard_s:.1f} s")
                                      + f"; past {shards} replica(s) there is no shard left to run")}


def scale_endpoint(*, requests: int, prompt_tokens: float, new_tokens: float, max_new_tokens: int, shard_prompts: int,
                   max_concurrency: int, requests_per_minute: int | None, tokens_per_minute: int | None,
                   usd: float | None, replicas: list[int], assume: ScaleAssumptions,
                   first_token_s: float | None = None, stream_tokens_per_s: float | None = None) -> dict:
    """Time of ``requests`` endpoint calls from N Ray workers, each with ``max_concurrency`` requests in flight, under
    the teacher's rate limits, which bind the whole job (one token bucket for every worker).

    One request takes ``first_token_s + new_tokens / stream_tokens_per_s``; a worker sustains ``max_concurrency``
    over that; the job sustains ``min(N x that, the ceiling)``, the ceiling being ``requests_per_minute`` and
    ``tokens_per_minute`` / (prompt + ``max_new_tokens``) tokens per request (what the client-side limiter counts).
    The dollars are the tokens' (the same for every N); the workers' own CPU time is not priced."""
    first = assume.first_token_s if first_token_s is None else first_token_s
    stream = assume.stream_tokens_per_s if stream_tokens_per_s is None else stream_tokens_per_s
    latency = first + new_tokens / stream
    per_replica = max_concurrency / latency  # requests/s one worker sustains
    ceilings = {}
    if requests_per_minute:
        ceilings["requests_per_minute"] = requests_per_minute / 60.0
    if tokens_per_minute:
        ceilings["tokens_per_minute"] = tokens_per_minute / 60.0 / (prompt_tokens + max_new_tokens)
    ceiling = min(ceilings.values()) if ceilings else None
    shards = max(1, math.ceil(requests / shard_prompts)) if requests else 0

    def rate(n: int) -> float:
        return min(n * per_replica, ceiling) if ceiling is not None else n * per_replica

    def wall(n: int) -> float:
        if not requests:
            return 0.0
        return assume.cluster_start_s + requests / rate(n) + math.ceil(shards / n) * assume.shard_overhead_s

    one = wall(1)
    rows = [{"replicas": n, "seconds": wall(n), "usd": usd, "requests_per_s": rate(n),
             "speedup": one / wall(n) if wall(n) else 1.0, "efficiency": (one / wall(n) / n) if wall(n) else 1.0,
             "bound": ("rate limit" if ceiling is not None and n * per_replica >= ceiling
                       else "shards (replicas past the shard count idle)" if n > shards else "replicas")}
            for n in replicas]
    saturating = math.ceil(ceiling / per_replica) if ceiling is not None else None
    knee = _knee(wall, max(1, min(shards, saturating) if saturating else shards), assume.knee_gain)
    ceiling_md = None if ceiling is None else {
        "requests_per_s": ceiling, "requests_per_minute": ceiling * 60,
        "tokens_per_minute": ceiling * 60 * (prompt_tokens + max_new_tokens),
        "binding": min(ceilings, key=ceilings.get), "replicas_to_reach_it": saturating,
        "minimum_seconds": requests / ceiling if requests else 0.0}
    why = (f"the rate limit ({ceiling * 60:,.0f} requests/min, set by teacher.{ceiling_md['binding']}) is reached "
           f"with {saturating} replica(s) of {per_replica * 60:,.0f} requests/min each; more only wait"
           if ceiling is not None else
           f"no rate limit is set, so only the start-up ({assume.cluster_start_s:.0f} s) and the {shards} shard(s) "
           f"bound it (the endpoint's own capacity is not modelled)")
    return {"kind": "endpoint", "requests": requests, "shards": shards, "shard_prompts": shard_prompts,
            "request_latency_s": latency, "first_token_s": first, "stream_tokens_per_s": stream,
            "requests_per_s_per_replica": per_replica, "max_concurrency_per_replica": max_concurrency,
            "rows": rows, "knee_replicas": knee, "max_useful_replicas": saturating or shards, "ceiling": ceiling_md,
            "why_more_stop_helping": why}


def plan_scaleout(spec: CampaignSpec, catalog: Catalog, facts: dict, teacher: ModelShape | None,
                  replicas: list[int] | tuple[int, ...] | None = None, assume: ScaleAssumptions | None = None) -> dict:
    """The teacher stage (``teacher_generations``) on 1..N Ray replicas: time, dollars, and for an endpoint the rate
    limit's ceiling; where more replicas stop helping (``knee_replicas``). ``replicas`` default: 1, 2, 4, ... 64 and
    ``execution.replicas``."""
    from campaign_orchestrator.costs.lines import teacher_entry

    t, ex, pl, c = spec.teacher, spec.execution, spec.cost.planner, spec.cost
    assume = assume or ScaleAssumptions()
    if assume.cluster_start_s is None:
        assume = ScaleAssumptions(**(asdict(assume) | {"cluster_start_s": cluster_start_for(spec)}))
    grid = sorted(set(replicas or DEFAULT_REPLICAS) | ({ex.replicas} if replicas is None else set()))
    if any(n < 1 for n in grid):
        raise PlanError(f"replica counts must be at least 1, got {grid}")
    requests = facts["train_prompts"] * t.sampling.n
    new_tok = t.sampling.max_new_tokens * pl.completion_fill
    p_tok = facts["prompt_tokens_teacher"]
    base = {"stage": "teacher_generations", "engine": ex.engine, "configured_replicas": ex.replicas,
            "assumptions": asdict(assume) | {"completion_fill": pl.completion_fill, "prompt_tokens": p_tok,
                                             "new_tokens": new_tok, "tokenizer": facts.get("tokenizer"),
                                             "billing": "every replica on its own device (a host-hour entry: its own "
                                                        "host), billed for the whole stage"}}
    entry = teacher_entry(spec, catalog)
    if t.api:
        usd = None
        if entry is not None:
            in_usd, out_usd = entry.token_usd(c.teacher_batch_api)
            usd = requests * (p_tok * in_usd + new_tok * out_usd) / 1e6
            base |= {"price_key": entry.key, "price_as_of": entry.as_of, "price_source": entry.source}
        perf = entry.perf if entry is not None else {}
        return base | scale_endpoint(
            requests=requests, prompt_tokens=p_tok, new_tokens=new_tok, max_new_tokens=t.sampling.max_new_tokens,
            shard_prompts=ex.shard_prompts, max_concurrency=t.max_concurrency,
            requests_per_minute=t.requests_per_minute, tokens_per_minute=t.tokens_per_minute, usd=usd,
            replicas=grid, assume=assume, first_token_s=perf.get("first_token_s"),
            stream_tokens_per_s=perf.get("stream_tokens_per_s"))
    if entry is None or teacher is None:
        raise PlanError("the scale-out table of a self-hosted teacher needs teacher.hardware and the teacher's config")
    tdt = compute_dtype_on(t.compute_dtype, entry)
    devices = max(t.tensor_parallel_size if t.backend == "vllm" else 1, math.ceil(ex.num_gpus_per_replica), 1)
    shared = facts.get("shared_prefix_tokens", 0.0)
    shard_n = min(ex.shard_prompts, requests) or 1
    p_eff = p_tok - shared * (1 - 1 / shard_n)  # a shard is one call: its prompts share the context prefix
    # CPU replicas of a local cluster share this host (its peak is the host's): at most cpus / cpus-per-replica at once
    local = ex.kuberay is None and not ex.ray_address and not ex.num_gpus_per_replica and entry.unit == "host-hour"
    slots = max(1, (os.cpu_count() or 1) // max(1, math.ceil(ex.num_cpus_per_replica))) if local else None
    if slots:
        base["assumptions"]["billing"] = (f"a local cluster: CPU replicas share this host ({os.cpu_count()} CPUs, "
                                          f"{slots} replica(s) at once), billed as one host")
    return base | scale_self_hosted(
        requests=requests, prompt_tokens=p_eff, new_tokens=new_tok,
        decode_tokens=decode_length(t.backend, t.sampling.temperature, t.sampling.max_new_tokens),
        shard_prompts=ex.shard_prompts, batch_size=t.batch_size, params=teacher.active_params,
        weight_bytes=teacher.params * DTYPE_BYTES[tdt], entry=entry, mfu=pl.generation_mfu, dtype=tdt,
        devices_per_replica=devices, tier=c.pricing_tier, replicas=grid, assume=assume, one_host_slots=slots)


def render_scaleout(s: dict) -> list[str]:
    """The replica table of :func:`plan_scaleout` as text lines."""
    head = (f"{s['stage']} on Ray replicas ({s['kind']}; {s['requests']:,} requests in {s['shards']:,} shard(s) of "
            f"{s['shard_prompts']}; execution.replicas is {s['configured_replicas']}):")
    lines = ["", head, f"  {'replicas':>8s} {'time':>12s} {'speed-up':>9s} {'efficiency':>10s} {'cost':>14s}  bound"]
    for r in s["rows"]:
        cost = "unknown" if r["usd"] is None else f"${r['usd']:,.4f}"
        lines.append(f"  {r['replicas']:>8d} {_duration(r['seconds']):>12s} {r['speedup']:>8.2f}× "
                     f"{r['efficiency']:>9.0%} {cost:>14s}  {r['bound']}")
    if s.get("ceiling"):
        cl = s["ceiling"]
        lines.append(f"  rate-limit ceiling: {cl['requests_per_minute']:,.0f} requests/min = "
                     f"{cl['tokens_per_minute']:,.0f} tokens/min as the limiter counts them (prompt + max_new_tokens), "
                     f"bound by teacher.{cl['binding']}; the stage takes at least {_duration(cl['minimum_seconds'])}")
    lines.append(f"  knee: {s['knee_replicas']} replica(s): {s['why_more_stop_helping']}")
    a = s["assumptions"]
    lines.append("  assumptions: " + ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in a.items() if v is not None)
                 + (f"; price {s['price_key']} as of {s['price_as_of']}" if s.get("price_key") else ""))
    return lines


def _duration(seconds: float) -> str:
    if seconds >= 3 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 180:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
