"""demo_models: the tiny teacher and student base built from a seed (cached by recipe hash), the MoE
student base, and the teacher with a byte-level BPE tokenizer (each its own recipe and hash).

The dense pair is one multi-asset, subsettable: both models come out of one build (one tokenizer trained
once, one cache directory with one ``_SUCCESS`` marker per recipe hash), so they stay one computation, but
a campaign job may select only the model it reads (``@demo/student`` with an API teacher selects
``demo_models/student`` alone; a campaign whose student is the MoE one selects only the teacher). A
materialization reports only the selected models.
"""

from dagster import AssetExecutionContext, AssetOut, MetadataValue, Output, asset, multi_asset

from assets.common import DEMO_GROUP
from campaign_orchestrator.demo.recipe import moe_recipe_hash, recipe_hash, xtok_recipe_hash
from resources.storage import ArtifactStore

NAMES = ("teacher", "student")


@multi_asset(
    outs={
        name: AssetOut(
            key=[DEMO_GROUP, name],
            group_name=DEMO_GROUP,
            kinds={"pytorch"},
            is_required=False,
            description=f"Demo {name} model (demo recipe), a real Llama checkpoint on disk.",
        )
        for name in NAMES
    },
    code_version=recipe_hash(),
    can_subset=True,
)
def demo_models(context: AssetExecutionContext, storage: ArtifactStore):
    from campaign_orchestrator.demo.recipe import cached_report, models_dir

    report = cached_report(storage.root_path())
    if report is None:  # build them (imports torch; a built set is only read)
        from campaign_orchestrator.demo.build import build_demo_models

        report = build_demo_models(storage.root_path(), log=context.log.info, moe=False)
    root = models_dir(storage.root_path())
    for name in NAMES:
        if name not in context.op_execution_context.selected_output_names:
            continue
        r = report[name]
        yield Output(
            {"key": report["recipe_hash"], "path": str(root / name)},
            output_name=name,
            metadata={
                "path": MetadataValue.path(str(root / name)),
                "exact_match_on_task": r["exact_match"],
                "parameters": r["parameters"],
                "train_seconds": r["train_seconds"],
                "cached": report["cached"],
                "build_seconds": report["build_seconds"],
            },
        )


@asset(
    key=[DEMO_GROUP, "moe_student"],
    group_name=DEMO_GROUP,
    kinds={"pytorch"},
    code_version=moe_recipe_hash(),
    description="Demo mixture-of-experts student base (a real Qwen3-MoE checkpoint: 4 routed experts, top-2).",
)
def demo_moe_student(context: AssetExecutionContext, storage: ArtifactStore):
    from campaign_orchestrator.demo.build import build_moe_student
    from campaign_orchestrator.demo.recipe import resolve

    r = build_moe_student(storage.root_path(), log=context.log.info)
    path = resolve("@demo/moe_student", storage.root_path())
    return Output(
        {"key": r["recipe_hash"], "path": str(path)},
        metadata={
            "path": MetadataValue.path(str(path)),
            "exact_match_on_task": r["exact_match"],
            "copy_exact_match": r["copy_exact_match"],
            "parameters": r["parameters"],
            "num_experts": r["num_experts"],
            "num_experts_per_tok": r["num_experts_per_tok"],
            "cached": r["cached"],
            "build_seconds": r["build_seconds"],
        },
    )


@asset(
    key=[DEMO_GROUP, "teacher_bpe"],
    group_name=DEMO_GROUP,
    kinds={"pytorch"},
    code_version=xtok_recipe_hash(),
    description="Demo cipher teacher with a byte-level BPE tokenizer (another tokenizer than the student's: "
    "cross-tokenizer logit distillation), a real Llama checkpoint.",
)
def demo_xtok_teacher(context: AssetExecutionContext, storage: ArtifactStore):
    from campaign_orchestrator.demo.build import build_xtok_teacher
    from campaign_orchestrator.demo.recipe import resolve

    r = build_xtok_teacher(storage.root_path(), log=context.log.info)
    path = resolve("@demo/teacher_bpe", storage.root_path())
    return Output(
        {"key": r["recipe_hash"], "path": str(path)},
        metadata={
            "path": MetadataValue.path(str(path)),
            "exact_match_on_task": r["exact_match"],
            "vocab_size": r["vocab_size"],
            "parameters": r["parameters"],
            "cached": r["cached"],
            "build_seconds": r["build_seconds"],
        },
    )
