"""student_adapter: LoRA/QLoRA training of the student by ``python -m training`` under torchrun, launched by the
context's training launcher (local torchrun or Kubernetes), under the stage's budget guard."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

# what keys the adapter, resolved for where the trainer runs (never `auto`): campaign_orchestrator/keys.py
from campaign_orchestrator.keys import (  # noqa: F401 - re-exported: versions, the sweep and tests use them
    ADDED_STUDENT_DEFAULTS,
    adapter_key_fields,
    job_policy_terms,
    key_policy,
    policy_mismatch,
    spec_as_trained,
    student_key_fields,
    training_key_fields,
)
from campaigns.spec import CampaignSpec
from stages.common import model_identity, stage_key
from stages.errors import StageError
from stages.outcome import Outcome
from stages.pricing import refuse_student
from stages.storage import Store


def adapter_precision(spec: CampaignSpec) -> str:
    """What the trainer will compute in, as ``<device kind>:<dtype>`` (``training.hardware`` aside): the local
    launcher's processes run on this host (its GPU when torch sees one, else its CPU, resolved as the trainer
    resolves it, from the cached per-host measurement); the Kubernetes launcher's on the cluster's GPUs, where
    ``auto`` is bf16 (as the planner assumes). The trainer's own resolution is checked against it when it
    ends (:func:`check_precision`)."""
    requested = spec.student.quantization.compute_dtype
    if spec.training.launcher == "local":
        from campaign_orchestrator.hardware import key_precision

        return key_precision(requested)
    return f"cuda:{'bfloat16' if requested == 'auto' else requested}"


def ran_precision(summary: dict) -> str | None:
    """The ``<device kind>:<dtype>`` a trainer's ``summary.json`` says it ran in (None: not recorded)."""
    if not summary.get("compute_dtype"):
        return None
    return f"{'cuda' if str(summary.get('device', 'cpu')).startswith('cuda') else 'cpu'}:{summary['compute_dtype']}"


def check_precision(spec: CampaignSpec, summary: dict, keyed: str, where) -> None:
    """Refuse to store an adapter under a key for another dtype than it was trained in."""
    ran = ran_precision(summary)
    if ran is not None and ran != keyed:
        raise StageError(
            f"campaign {spec.name}: the adapter was trained in {ran} but its cache key was made for {keyed} "
            f"(student.quantization.compute_dtype {spec.student.quantization.compute_dtype}); it is not "
            f"stored under that key ({where}). Set student.quantization.compute_dtype to "
            f"{ran.split(':')[1]} explicitly, or run the trainer where it resolves as keyed",
            retry=False,
        )


def teacher_tokenizer_path(spec: CampaignSpec, storage: Store) -> str | None:
    """Where the teacher's tokenizer is, for the logit-distillation vocabulary check."""
    if spec.training.distillation.loss not in ("logits", "on_policy"):
        return None
    if spec.training.distillation.teacher_tokenizer:
        return str(storage.resolve_model(spec.training.distillation.teacher_tokenizer, spec.project_dir))
    if spec.teacher.backend == "transformers":
        return str(storage.resolve_model(spec.teacher.model, spec.project_dir))
    return None  # the trainer refuses to start and says which field to set


def on_policy_job(spec: CampaignSpec, storage: Store, prompts: dict):
    """The trainer's on-policy inputs (``training.config.OnPolicyJob``): the training prompts, how the student asks
    them, and the teacher that scores the samples (its directory when it runs in process)."""
    from stages.teacher import teacher_model
    from training.config import OnPolicyJob

    t = spec.teacher
    tm = teacher_model(storage, spec)
    model_path = tm.path
    compute_dtype = t.compute_dtype if t.compute_dtype != "auto" else spec.student.quantization.compute_dtype
    return OnPolicyJob(
        prompts_path=prompts["train_path"],
        template=spec.dataset.template,
        teacher_backend=t.backend,
        teacher_model_path=str(model_path) if model_path is not None else None,
        teacher_compute_dtype=compute_dtype,
        teacher_identity=tm.identity,
        teacher=t.model_dump(mode="json"),
        context=[m.model_dump() for m in t.context],
        context_categories=t.context_categories,
    )


def on_policy_key_fields(spec: CampaignSpec, job) -> dict | None:
    """What the samples and their scores depend on beyond the training settings: the prompts and the teacher."""
    if job is None:
        return None
    return {
        "prompts": job.prompts_path and _file_sha(job.prompts_path),
        "teacher": job.teacher_identity,
        "context": job.context,
        "context_categories": job.context_categories,
        "template": job.template,
    }


def _file_sha(path: str) -> str:
    from campaign_orchestrator.content import file_sha256

    return file_sha256(path)


def refuse_before_launch(spec: CampaignSpec, base) -> None:
    """Settings the student model refuses (a mixture of experts: experts nothing trains, a per-expert rank
    below 1, targets that match nothing), before any process starts; the trainer checks them again."""
    problems = refuse_student(spec, base)
    if problems:
        raise ValueError(
            f"campaign {spec.name}: student {spec.student.base_model} ({base}) refuses these settings, "
            "nothing was launched:\n  " + "\n  ".join(problems)
        )


def adopt_trial(sweep: dict, out, precision: str | None = None) -> dict | None:
    """The sweep's best trial ran the full length (the top rung is training.max_steps) with exactly these settings:
    its adapter, metrics and summary become this stage's output instead of a second identical run. None when it
    did not (the cap stopped the sweep first): the stage trains."""
    from pathlib import Path

    d = Path(sweep.get("best_dir") or "")
    if not sweep.get("best_complete") or not (d / "adapter" / "adapter_config.json").exists():
        return None
    summary = json.loads((d / "summary.json").read_text())
    if summary.get("rung"):
        return None
    if precision is not None and ran_precision(summary) not in (None, precision):
        return None  # trained in another dtype than this adapter's key says (another host): train again
    shutil.copytree(d / "adapter", out / "adapter", dirs_exist_ok=True)
    shutil.copy2(d / "metrics.parquet", out / "metrics.parquet")
    summary["adapter_dir"] = str(out / "adapter")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def run(spec: CampaignSpec, inputs: dict, ctx) -> Outcome:
    """The adapter trained (or adopted from the sweep's best trial) unless the stage's content key is complete.
    ``inputs``: ``dataset`` (the tokenized dataset's manifest; with ``teacher_generations: none`` the prompts
    stage's: no tokenized dataset), ``prompts`` (on-policy distillation), ``sweep`` (the sweep's result: ``spec``
    then trains with its best parameters). ``notes``: ``recipe`` (the recipe checks' findings), ``mlflow_run_id``."""
    sweep = inputs.get("sweep")
    if sweep is not None:
        spec = spec.with_params(sweep["best_params"])
    dataset, prompts, storage = inputs["dataset"], inputs.get("prompts"), ctx.store
    s, tr = spec.student, spec.training
    base = storage.resolve_model(s.base_model, spec.project_dir)
    refuse_before_launch(spec, base)
    precision = adapter_precision(spec)  # resolved: an adapter trained in bf16 is not one trained in fp32
    skips = tr.distillation.skips_teacher
    on_policy = None
    if tr.distillation.loss == "on_policy":
        on_policy = on_policy_job(spec, storage, dataset if skips else prompts)
    # `micro_batch_size: auto` keyed as the micro-batch the trainer will pick on its device (campaign_orchestrator/keys)
    policy = key_policy(
        spec, ctx.pricing.catalog_for(spec), base, precision, dataset.get("splits", {}).get("train", {}).get("rows")
    )
    key_parts = [dataset["key"], model_identity(base, s.revision), adapter_key_fields(spec, precision, policy)]
    recipe = recipe_findings(spec_as_trained(spec, policy), dataset, ctx)  # campaign_orchestrator/recipe_checks.py
    if on_policy is not None:
        key_parts.append(on_policy_key_fields(spec, on_policy))
    k = content_key(*key_parts)
    sd = storage.stage(spec.name, "student_adapter", k)
    cached = sd.is_complete()
    adopted = None
    if not cached and sweep is not None:
        adopted = _adopt_best_trial(ctx, spec, sd, base, sweep, precision)
    if not cached and adopted is None:
        _train(ctx, spec, sd, k, base, dataset, on_policy, (precision, policy))
    m = sd.manifest()
    notes: dict = {"recipe": recipe}
    if spec.tracking.mlflow is not None and not cached:
        from stages.tracking import log_training

        notes["mlflow_run_id"] = log_training(spec, storage.root_path(), m, ctx.run_id)
    return Outcome(m, cached, notes)


def content_key(dataset_key: str, base_identity: str, training_fields: dict, on_policy: dict | None = None) -> str:
    """The dataset, the base's weights, the settings that change the adapter (:func:`training_key_fields`) and, for
    on-policy distillation, what its samples and scores depend on (:func:`on_policy_key_fields`)."""
    parts = [dataset_key, base_identity, training_fields]
    if on_policy is not None:
        parts.append(on_policy)
    return stage_key("adapter/v1", *parts)


def _adopt_best_trial(ctx, spec: CampaignSpec, sd, base, sweep: dict, precision: str):
    """The sweep's best trial as the candidate when it trained the full run with these settings (committed to
    ``sd``, paid for in the sweep): its number, else None."""
    tr = spec.training
    out = sd.ensure()
    shutil.rmtree(out / "adapter", ignore_errors=True)
    summary = adopt_trial(sweep, out, precision)
    if summary is None:
        return None
    adopted = sweep["best_trial"]
    ctx.log.info(
        f"student_adapter: the sweep's best trial {adopted} ({sweep['best_params']}) trained "
        f"the full {tr.max_steps} steps with these settings: its adapter is the candidate"
    )
    sd.commit(
        {
            "adapter_path": str(out / "adapter"),
            "base_model_path": str(base),
            "summary": summary,
            "metrics_path": str(out / "metrics.parquet"),
            "logs": [],
            "wall_seconds": 0.0,
            "cost_lines": [],
            "billed_hardware": tr.hardware,
            "from_sweep_trial": adopted,
            "sweep_params": sweep["best_params"],
        }
    )  # paid for in the sweep (ledger: hparam_sweep)
    return adopted


def _train(ctx, spec: CampaignSpec, sd, k: str, base, dataset: dict, on_policy, keyed: tuple) -> None:
    """Launch the trainer into ``sd`` with the context's launcher under the stage's budget guard, bill what it ran
    on and commit (``keyed``: the precision and training policy the key names)."""
    from training.config import TrainJob

    precision, policy = keyed

    storage, pricing = ctx.store, ctx.pricing
    s, tr = spec.student, spec.training
    skips = tr.distillation.skips_teacher
    out = sd.ensure()
    shutil.rmtree(out / "adapter", ignore_errors=True)
    remote = tr.checkpoint.remote_uri
    job = TrainJob(
        campaign=spec.name,
        base_model_path=str(base),
        dataset_path="" if skips else dataset["dataset_path"],
        validation_path=None if skips else dataset.get("validation_path"),
        output_dir=str(out),
        student=s,
        training=tr,
        teacher_tokenizer_path=teacher_tokenizer_path(spec, storage),
        on_policy=on_policy,
        gpu_required=pricing.gpu_required(spec),
        checkpoint_uri=f"{remote.rstrip('/')}/{spec.name}/student_adapter/{k}" if remote else None,
        policy_terms=job_policy_terms(spec, pricing.catalog_for(spec)),  # the planner's inputs, for `auto`
    )
    t0 = time.perf_counter()
    cluster = {"kubernetes": spec.kubernetes} if tr.launcher == "k8s" else {}  # k8s: where to run
    launched = ctx.train(job, out, budget=pricing.guard(ctx, spec, sd), **cluster)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    check_precision(spec, summary, precision, out)
    if reason := policy_mismatch(summary, policy):  # stored under a key for another micro-batch: refused
        raise StageError(f"campaign {spec.name}: {reason} ({out})", retry=False)
    sd.commit(
        {
            "adapter_path": str(out / "adapter"),
            "base_model_path": str(base),
            "summary": summary,
            "metrics_path": str(out / "metrics.parquet"),
            "logs": launched["logs"],
            "wall_seconds": wall,
        }
        | _training_cost(ctx, spec, summary, wall)
    )


def _training_cost(ctx, spec: CampaignSpec, summary: dict, wall: float) -> dict:
    """The training's cost lines at what it ran on, plus on-policy distillation's teacher scoring per round."""
    # billed at what it ran on: a GPU entry only when the trainer had GPUs (it refuses otherwise, unless
    # allow_cpu_fallback: then CPU time at training.cpu_hardware)
    pricing = ctx.pricing
    bill = pricing.bill(spec, "student_adapter", {"seconds": wall, "device": summary.get("device", "cpu")})
    lines, billed, note = bill["lines"], bill["billed_hardware"], bill["billing_note"]
    if note:
        ctx.log.warning(note)
    scoring, unknown = None, None
    if summary.get("on_policy"):  # the teacher's prefills of the student's samples, one set of lines per round
        scoring = pricing.bill(spec, "on_policy_scoring", {"rounds": summary["on_policy"]["per_round"]})
        if scoring["lines"] is None:  # an unpriced API teacher: the training line stays, the total is unknown
            unknown = "unknown: the teacher scored the student's samples, and its teacher.price is `unpriced`"
            ctx.log.warning(f"student_adapter cost {unknown}")
        elif lines is not None:
            lines = lines + scoring["lines"]
        if scoring["billing_note"]:
            ctx.log.info(scoring["billing_note"])
    return {
        "cost_lines": lines,
        "billed_hardware": billed,
        **({"billing_note": note} if note else {}),
        **({"cost_unknown": unknown} if unknown else {}),
        **(
            {
                "on_policy_scoring_usd": scoring["usd"],
                "on_policy_scoring_rounds_usd": scoring["parts_usd"],
                "on_policy_scoring_note": scoring["billing_note"],
            }
            if scoring is not None
            else {}
        ),
    }


def recipe_findings(spec: CampaignSpec, dataset: dict, ctx) -> list:
    """The recipe checks on the tokenized dataset about to be trained on (its train split; replay examples are the
    ``replay:`` ids) and the campaign's last evaluated diagnosis, each failing one logged as a warning before any
    training time is spent."""
    from campaign_orchestrator.recipe_checks import check_recipe, facts_from_dataset, latest_diagnosis

    if "splits" not in dataset:  # on-policy without a teacher stage: the prompts are the data
        return []
    replay = 0
    if spec.data.replay is not None:
        import pyarrow.parquet as pq

        from campaign_orchestrator.dataset.replay import REPLAY_PREFIX

        for f in sorted(Path(dataset["dataset_path"]).glob("*.parquet")):
            for ids in pq.read_table(f, columns=["example_ids"]).column("example_ids").to_pylist():
                replay += sum(str(x).startswith(REPLAY_PREFIX) for x in ids)
    diagnosis = latest_diagnosis(ctx.store.root_path() / spec.name)  # the last evaluation's causes, if any
    findings = check_recipe(spec, facts_from_dataset(spec, dataset, replay), diagnosis)
    for f in findings:
        ctx.log.warning(f"recipe check {f.check}: {f.message}")
    return findings


def triage_table(triage: dict) -> str:
    """A profiled run's per-rank triage as a Markdown table (``training.triage.markdown_table``)."""
    from training.triage import markdown_table

    return markdown_table(triage)
