"""student_adapter: LoRA/QLoRA training of the student by ``python -m training`` under torchrun."""

import json
import shutil
import time
from pathlib import Path

from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, key, model_deps, model_identity, stage_key
from assets.perf_metadata import profile_metadata
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource, refuse_student
from resources.storage import ArtifactStore
from resources.training_launcher import TrainingLauncher

# Student fields added after adapters were first keyed: left out of the key at their defaults, so adding
# them changed no existing adapter's key (nor its cache, nor the model-change sensor's versions).
ADDED_STUDENT_DEFAULTS = {("lora", "target_parameters"): [], ("lora", "use_dora"): False}


def student_key_fields(spec: CampaignSpec) -> dict:
    """The student settings that key its adapter (see ``ADDED_STUDENT_DEFAULTS``; ``moe`` at its defaults too)."""
    from campaigns.spec import MoeSpec

    out = spec.student.model_dump()
    for (section, name), default in ADDED_STUDENT_DEFAULTS.items():
        if out[section][name] == default:
            del out[section][name]
    if spec.student.moe == MoeSpec():
        del out["moe"]
    return out


def training_key_fields(spec: CampaignSpec, precision: str | None = None) -> dict:
    """Settings that change the trained adapter (launcher, logging, checkpointing and timeouts do not,
    so changing them keeps an interrupted run's checkpoints usable). With ``precision`` (the resolved
    ``<device>:<dtype>``, :func:`adapter_precision`) it replaces ``quantization.compute_dtype``, so the
    adapter's key says what it was trained in, never ``auto`` (without: the spec's setting, for the code
    versions computed when the code location loads, where torch is not imported)."""
    student = student_key_fields(spec)
    if precision is not None:
        student["quantization"]["compute_dtype"] = precision
    training = spec.training.model_dump(
        exclude={
            "launcher",
            "log_every",
            "hardware",
            "allow_cpu_fallback",
            "cpu_hardware",
            "checkpoint",
            "collective_timeout_s",
            "diagnostics",
            "distributed_env",
            "reshard_after_forward",
            "compile",
        }
    )  # speed, not the adapter
    if spec.training.distillation.loss != "on_policy":  # added with on-policy distillation: keys no other adapter
        del training["distillation"]["on_policy"]
    if spec.training.selection.rule == "last":  # added with checkpoint selection: keys no other adapter
        del training["selection"]
    return {"student": student, "training": training}


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
    from dagster import Failure

    ran = ran_precision(summary)
    if ran is not None and ran != keyed:
        raise Failure(
            f"campaign {spec.name}: the adapter was trained in {ran} but its cache key was made for {keyed} "
            f"(student.quantization.compute_dtype {spec.student.quantization.compute_dtype}); it is not "
            f"stored under that key ({where}). Set student.quantization.compute_dtype to "
            f"{ran.split(':')[1]} explicitly, or run the trainer where it resolves as keyed",
            allow_retries=False,
        )


def teacher_tokenizer_path(spec: CampaignSpec, storage: ArtifactStore) -> str | None:
    """Where the teacher's tokenizer is, for the logit-distillation vocabulary check."""
    if spec.training.distillation.loss not in ("logits", "on_policy"):
        return None
    if spec.training.distillation.teacher_tokenizer:
        return str(storage.resolve_model(spec.training.distillation.teacher_tokenizer, spec.project_dir))
    if spec.teacher.backend == "transformers":
        return str(storage.resolve_model(spec.teacher.model, spec.project_dir))
    return None  # the trainer refuses to start and says which field to set


def on_policy_job(spec: CampaignSpec, storage: ArtifactStore, prompts: dict):
    """The trainer's on-policy inputs (``training.config.OnPolicyJob``): the training prompts, how the student asks
    them, and the teacher that scores the samples (its directory when it runs in process)."""
    from assets.teacher_generations import teacher_model_path
    from campaign_orchestrator.generation.backends import spec_identity
    from training.config import OnPolicyJob

    t = spec.teacher
    model_path = teacher_model_path(storage, spec)
    weights_id = model_identity(model_path, t.revision) if model_path is not None else None
    compute_dtype = t.compute_dtype if t.compute_dtype != "auto" else spec.student.quantization.compute_dtype
    return OnPolicyJob(
        prompts_path=prompts["train_path"],
        template=spec.dataset.template,
        teacher_backend=t.backend,
        teacher_model_path=str(model_path) if model_path is not None else None,
        teacher_compute_dtype=compute_dtype,
        teacher_identity=spec_identity(t, model_path, weights_id),
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


def moe_metadata(moe: dict | None) -> dict:
    """A mixture-of-experts student's metadata: trainable parameters by kind, whether the routed experts are
    trained and quantized, tokens routed to each expert, the expert-gradient checks."""
    if not moe:
        return {}
    t = moe["trainable_by_kind"]
    return {
        "trainable_attention": t["attention"],
        "trainable_dense_mlp": t["dense_mlp"],
        "trainable_routed_experts": t["routed_experts"],
        "trainable_router": t["router"],
        "trainable_breakdown": MetadataValue.json({"trainable": t, "parameters": moe["parameters_by_kind"]}),
        "routed_experts_trained": moe["routed_experts_trained"],
        "experts_quantized": moe["experts_quantized"],
        "num_experts": moe["num_experts"],
        "num_experts_per_tok": moe["num_experts_per_tok"],
        "expert_rank": moe["expert_rank"],
        "router": moe["router"],
        "aux_loss_coef": moe["aux_loss_coef"],
        "expert_lora_b_nonzero": f"{moe['expert_lora_b_nonzero']}/{moe['expert_lora_b_slices']}",
        "routed_tokens_per_expert": MetadataValue.json(moe["routed_tokens_per_expert"]),
        "expert_grad_checks": MetadataValue.json(moe["expert_grad_checks"]),
        "routing_collapse_warnings": len(moe["routing_collapse_warnings"]),
    }


def on_policy_metadata(op: dict | None, manifest: dict | None = None) -> dict:
    """An on-policy run's rounds: how many, samples, teacher tokens scored (prefill), mean reverse KL, the
    per-round table, and what the teacher's scoring cost (an API teacher: its input price; in process: in the
    training line)."""
    if not op:
        return {}
    m = manifest or {}
    return {
        "teacher_scoring_usd": m.get("on_policy_scoring_usd"),
        "teacher_scoring_note": m.get("on_policy_scoring_note"),
        "teacher_scoring_usd_by_round": MetadataValue.json(m["on_policy_scoring_rounds_usd"])
        if m.get("on_policy_scoring_rounds_usd")
        else None,
        "on_policy_rounds": op["rounds"],
        "on_policy_steps": op["on_policy_steps"],
        "off_policy_steps": op["off_policy_steps"],
        "student_samples": op["samples"],
        "teacher_tokens_scored": op["teacher_prefill_tokens"],
        "sampled_tokens": op["sampled_tokens"],
        "mean_reverse_kl": op.get("mean_reverse_kl"),
        "sampling_seconds": op["sampling_seconds"],
        "scoring_seconds": op["scoring_seconds"],
        "rounds": MetadataValue.json(op["per_round"]),
    }


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


def _adapter_ins(spec: CampaignSpec) -> dict:
    """The asset's inputs: the tokenized dataset (the prompts, fully on-policy without a teacher stage), the
    prompts as well for on-policy distillation, the sweep's best trial when the campaign sweeps."""
    tr = spec.training
    # fully on-policy without a teacher stage: the prompts are the trainer's only data
    ins = {"dataset": AssetIn(key(spec, "prompts" if tr.distillation.skips_teacher else "tokenized_dataset"))}
    if tr.distillation.loss == "on_policy" and not tr.distillation.skips_teacher:
        ins["prompts"] = AssetIn(key(spec, "prompts"))
    if spec.sweep is not None:
        ins["sweep"] = AssetIn(key(spec, "hparam_sweep"))
    return ins


def _adapter_asset(spec: CampaignSpec, ins: dict):
    """The ``@asset`` decorator of the campaign's ``student_adapter``."""
    s, tr = spec.student, spec.training
    return asset(
        key=key(spec, "student_adapter"),
        group_name=spec.name,
        kinds={"pytorch"},
        ins=ins,
        deps=model_deps(s.base_model),
        pool="gpu",
        description=(
            f"LoRA r={s.lora.r} on `{s.base_model}` ({'4-bit QLoRA' if s.quantization.load_in_4bit else 'bf16'}),"
            f" {tr.nodes} node(s) × {tr.processes_per_node} process(es), sharding {tr.sharding}"
            + ("; parameters from the sweep's best trial (hparam_sweep)." if spec.sweep else ".")
        ),
    )


def build(spec: CampaignSpec):
    ins = _adapter_ins(spec)
    decorate = _adapter_asset(spec, ins)
    if spec.sweep is None and "prompts" in ins:

        @decorate
        def student_adapter(
            context: AssetExecutionContext,
            dataset: dict,
            prompts: dict,
            storage: ArtifactStore,
            launcher: TrainingLauncher,
            pricing: PricingResource,
        ) -> Output[dict]:
            return train_adapter(context, spec, dataset, storage, launcher, pricing, prompts=prompts)
    elif spec.sweep is None:

        @decorate
        def student_adapter(
            context: AssetExecutionContext,
            dataset: dict,
            storage: ArtifactStore,
            launcher: TrainingLauncher,
            pricing: PricingResource,
        ) -> Output[dict]:
            return train_adapter(context, spec, dataset, storage, launcher, pricing)
    else:

        @decorate
        def student_adapter(
            context: AssetExecutionContext,
            dataset: dict,
            sweep: dict,
            storage: ArtifactStore,
            launcher: TrainingLauncher,
            pricing: PricingResource,
        ) -> Output[dict]:
            return train_adapter(
                context, spec.with_params(sweep["best_params"]), dataset, storage, launcher, pricing, sweep
            )

    return student_adapter


def train_adapter(
    context: AssetExecutionContext,
    spec: CampaignSpec,
    dataset: dict,
    storage: ArtifactStore,
    launcher: TrainingLauncher,
    pricing: PricingResource,
    sweep: dict | None = None,
    prompts: dict | None = None,
) -> Output[dict]:
    """The stage's work for ``spec`` (the campaign, or the campaign with the sweep's best parameters). With
    ``teacher_generations: none`` ``dataset`` is the prompts stage's manifest (no tokenized dataset)."""
    s, tr = spec.student, spec.training
    base = storage.resolve_model(s.base_model, spec.project_dir)
    refuse_before_launch(spec, base)
    recipe = recipe_findings(spec, dataset, context)  # recipe checks: campaign_orchestrator/recipe_checks.py
    precision = adapter_precision(spec)  # resolved: an adapter trained in bf16 is not one trained in fp32
    skips = tr.distillation.skips_teacher
    on_policy = None
    if tr.distillation.loss == "on_policy":
        on_policy = on_policy_job(spec, storage, dataset if skips else prompts)
    key_parts = [dataset["key"], model_identity(base, s.revision), training_key_fields(spec, precision)]
    if on_policy is not None:
        key_parts.append(on_policy_key_fields(spec, on_policy))
    k = stage_key("adapter/v1", *key_parts)
    sd = storage.stage(spec.name, "student_adapter", k)
    cached = sd.is_complete()
    adopted = None
    if not cached and sweep is not None:
        adopted = _adopt_best_trial(context, spec, sd, base, sweep, precision)
    if not cached and adopted is None:
        _train(context, spec, sd, k, base, dataset, on_policy, precision, (storage, launcher, pricing))
    m = sd.manifest()
    md = adapter_metadata(m, cached, sweep)
    md["recipe_checks"] = MetadataValue.json([f.as_dict() for f in recipe]) if recipe else "all pass"
    if spec.tracking.mlflow is not None and not cached:
        from assets.tracking import log_training

        md["mlflow_run_id"] = log_training(spec, storage.root_path(), m, context.run_id)
    return Output(m, metadata={k: v for k, v in md.items() if v is not None})


def _adopt_best_trial(context, spec: CampaignSpec, sd, base, sweep: dict, precision: str):
    """The sweep's best trial as the candidate when it trained the full run with these settings (committed to
    ``sd``, paid for in the sweep): its number, else None."""
    tr = spec.training
    out = sd.ensure()
    shutil.rmtree(out / "adapter", ignore_errors=True)
    summary = adopt_trial(sweep, out, precision)
    if summary is None:
        return None
    adopted = sweep["best_trial"]
    context.log.info(
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


def _train(
    context, spec: CampaignSpec, sd, k: str, base, dataset: dict, on_policy, precision: str, resources: tuple
) -> None:
    """Launch the trainer into ``sd`` under the stage's budget guard, bill what it ran on and commit
    (``resources``: storage, launcher, pricing)."""
    from training.config import TrainJob

    storage, launcher, pricing = resources
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
    )
    t0 = time.perf_counter()
    cluster = {"kubernetes": spec.kubernetes} if tr.launcher == "k8s" else {}  # k8s: where to run
    launched = launcher.launch(context, job, out, budget=pricing.guard(context, spec, sd), **cluster)
    wall = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    check_precision(spec, summary, precision, out)
    sd.commit(
        {
            "adapter_path": str(out / "adapter"),
            "base_model_path": str(base),
            "summary": summary,
            "metrics_path": str(out / "metrics.parquet"),
            "logs": launched["logs"],
            "wall_seconds": wall,
        }
        | _training_cost(context, spec, pricing, summary, wall)
    )


def _training_cost(context, spec: CampaignSpec, pricing: PricingResource, summary: dict, wall: float) -> dict:
    """The training's cost lines at what it ran on, plus on-policy distillation's teacher scoring per round."""
    # billed at what it ran on: a GPU entry only when the trainer had GPUs (it refuses otherwise, unless
    # allow_cpu_fallback: then CPU time at training.cpu_hardware)
    bill = pricing.bill(spec, "student_adapter", {"seconds": wall, "device": summary.get("device", "cpu")})
    lines, billed, note = bill["lines"], bill["billed_hardware"], bill["billing_note"]
    if note:
        context.log.warning(note)
    scoring, unknown = None, None
    if summary.get("on_policy"):  # the teacher's prefills of the student's samples, one set of lines per round
        scoring = pricing.bill(spec, "on_policy_scoring", {"rounds": summary["on_policy"]["per_round"]})
        if scoring["lines"] is None:  # an unpriced API teacher: the training line stays, the total is unknown
            unknown = "unknown: the teacher scored the student's samples, and its teacher.price is `unpriced`"
            context.log.warning(f"student_adapter cost {unknown}")
        elif lines is not None:
            lines = lines + scoring["lines"]
        if scoring["billing_note"]:
            context.log.info(scoring["billing_note"])
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


def adapter_metadata(m: dict, cached: bool, sweep: dict | None) -> dict:
    """The adapter stage's manifest as Dagster metadata (None values still in: the caller drops them)."""
    sm = m["summary"]
    md = (
        base_metadata(m, cached)
        | {
            "adapter": MetadataValue.path(m["adapter_path"]),
            "metrics": MetadataValue.path(m["metrics_path"]),
            "steps": sm["steps"],
            "first_loss": sm["first_loss"],
            "final_loss": sm["final_loss"],
            "tokens": sm["tokens"],
            "tokens_per_s": sm["tokens_per_s"],
            "train_seconds": sm["train_seconds"],
            "world_size": sm["world_size"],
            "effective_batch": sm["effective_batch"],
            "trainable_parameters": sm["trainable_parameters"],
            "adapter_bytes": sm["adapter_bytes"],
            "peak_memory_mb": sm["peak_memory_mb"],
            "eval_loss_before": sm.get("eval_loss_before"),
            "eval_loss": sm.get("eval_loss"),
            "skipped_steps": sm.get("skipped_steps", 0),
            "resumed_from_step": sm.get("resumed_from_step"),
            "loss_kind": sm.get("loss", "sequence"),
            "sharding": sm.get("sharding"),
            "gpu_hours": float(sum(line["quantity"] for line in m["cost_lines"] if line["unit"] == "gpu-hour")),
            "device": sm.get("device"),
            "billed_hardware": m.get("billed_hardware"),
            "billing_note": m.get("billing_note"),
            "compute_dtype": sm.get("compute_dtype"),
            "compute_dtype_reason": sm.get("compute_dtype_reason"),
        }
        | on_policy_metadata(sm.get("on_policy"), m)
        | profile_metadata(m["path"])
    )
    if sm.get("selection"):  # training.selection: the kept checkpoint, not the last
        md |= {
            "kept_step": sm["selection"]["kept_step"],
            "kept_because": sm["selection"]["reason"],
            "selection": MetadataValue.json(sm["selection"]),
        }
    if sm.get("merged_dir"):
        md["merged_model"] = MetadataValue.path(sm["merged_dir"])
    if sm.get("distillation_alignment"):  # a teacher of another tokenizer: positions per part of the loss
        md["distillation_alignment"] = MetadataValue.json(sm["distillation_alignment"])
    md |= moe_metadata(sm.get("moe"))
    if m.get("cost_unknown"):  # never $0: an unpriced API teacher scored the student's samples
        md |= {"cost_usd": m["cost_unknown"], "spent_this_run_usd": "0 (cached)" if cached else m["cost_unknown"]}
    if m.get("from_sweep_trial") is not None or sweep is not None:
        md |= {
            "from_sweep_trial": m.get("from_sweep_trial"),
            "sweep_params": MetadataValue.json(sweep["best_params"]) if sweep else None,
        }
    return md


def recipe_findings(spec: CampaignSpec, dataset: dict, context) -> list:
    """The recipe checks on the tokenized dataset about to be trained on (its train split; replay examples are the
    ``replay:`` ids), each failing one logged as a warning before any training time is spent."""
    from campaign_orchestrator.recipe_checks import check_recipe, facts_from_dataset

    if "splits" not in dataset:  # on-policy without a teacher stage: the prompts are the data
        return []
    replay = 0
    if spec.data.replay is not None:
        import pyarrow.parquet as pq

        from campaign_orchestrator.dataset.replay import REPLAY_PREFIX

        for f in sorted(Path(dataset["dataset_path"]).glob("*.parquet")):
            for ids in pq.read_table(f, columns=["example_ids"]).column("example_ids").to_pylist():
                replay += sum(str(x).startswith(REPLAY_PREFIX) for x in ids)
    findings = check_recipe(spec, facts_from_dataset(spec, dataset, replay))
    for f in findings:
        context.log.warning(f"recipe check {f.check}: {f.message}")
    return findings
