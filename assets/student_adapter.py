"""student_adapter: LoRA/QLoRA training of the student by ``python -m training`` under torchrun
(``stages/student_adapter.py``), launched by the ``launcher`` resource."""

from dagster import AssetExecutionContext, AssetIn, MetadataValue, Output, asset

from assets.common import base_metadata, dagster_failures, for_people, key, model_deps, stage_context
from assets.perf_metadata import profile_metadata
from campaigns.spec import CampaignSpec
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from resources.training_launcher import TrainingLauncher
from stages import student_adapter as stage


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
            return train_adapter(context, spec, {"dataset": dataset, "prompts": prompts}, storage, launcher, pricing)
    elif spec.sweep is None:

        @decorate
        def student_adapter(
            context: AssetExecutionContext,
            dataset: dict,
            storage: ArtifactStore,
            launcher: TrainingLauncher,
            pricing: PricingResource,
        ) -> Output[dict]:
            return train_adapter(context, spec, {"dataset": dataset}, storage, launcher, pricing)
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
            return train_adapter(context, spec, {"dataset": dataset, "sweep": sweep}, storage, launcher, pricing)

    return student_adapter


def train_adapter(
    context: AssetExecutionContext,
    spec: CampaignSpec,
    inputs: dict,
    storage: ArtifactStore,
    launcher: TrainingLauncher,
    pricing: PricingResource,
) -> Output[dict]:
    """The stage (``stages/student_adapter.py``) run with the asset's inputs, its manifest as metadata."""
    with dagster_failures():
        out = stage.run(spec, inputs, stage_context(context, storage, pricing, launcher=launcher))
    md = adapter_metadata(out.manifest, out.cached, inputs.get("sweep"))
    recipe = out.notes["recipe"]
    md["recipe_checks"] = MetadataValue.json([f.as_dict() for f in recipe]) if recipe else "all pass"
    if "mlflow_run_id" in out.notes:
        md["mlflow_run_id"] = out.notes["mlflow_run_id"]
    return Output(out.manifest, metadata=for_people({k: v for k, v in md.items() if v is not None}))


def adapter_metadata(m: dict, reused: bool, sweep: dict | None) -> dict:
    """The adapter stage's manifest as Dagster metadata (None values still in: the caller drops them)."""
    sm = m["summary"]
    md = (
        base_metadata(m, reused)
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
    if m.get("from_sweep_trial") is not None or sweep is not None:
        md |= {
            "from_sweep_trial": m.get("from_sweep_trial"),
            "sweep_params": MetadataValue.json(sweep["best_params"]) if sweep else None,
        }
    return md
