"""demo_models: the tiny teacher and student base built from a seed (cached by recipe hash), the MoE
student base, and the teacher with a byte-level BPE tokenizer (each its own recipe and hash).

The dense pair is one multi-asset, subsettable: both models come out of one build (one tokenizer trained
once, one cache directory with one ``_SUCCESS`` marker per recipe hash), so they stay one computation, but
a campaign job may select only the model it reads (``@demo/student`` with an API teacher selects
``demo_models/student`` alone; a campaign whose student is the MoE one selects only the teacher). A
materialization reports only the selected models.
"""

from dagster import AssetExecutionContext, AssetOut, MetadataValue, Output, asset, multi_asset

from assets.common import DEMO_GROUP, for_people
from resources.storage import ArtifactStore
from stages import demo_models as stage
from stages.pricing import seconds

RECIPE_HASH, MOE_RECIPE_HASH, XTOK_RECIPE_HASH = stage.recipe_hashes()

NAMES = ("teacher", "student")


def built(reused: bool, build_seconds: float) -> dict:
    """Whether the models were built by this materialization or found built (by their recipe hash), and one duration:
    the build's (not this run's when found built)."""
    took = seconds(build_seconds)
    return {"reused": reused, "time": f"reused (took {took} when built)" if reused else took}


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
    code_version=RECIPE_HASH,
    can_subset=True,
)
def demo_models(context: AssetExecutionContext, storage: ArtifactStore):
    report, root = stage.demo_models(storage.store(), context.log.info)
    for name in NAMES:
        if name not in context.op_execution_context.selected_output_names:
            continue
        r = report[name]
        yield Output(
            {"key": report["recipe_hash"], "path": str(root / name)},
            output_name=name,
            metadata=for_people(
                {
                    "path": MetadataValue.path(str(root / name)),
                    **built(report["cached"], report["build_seconds"]),
                    "exact_match_on_task": r["exact_match"],
                    "parameters": r["parameters"],
                    "train_seconds": r["train_seconds"],
                }
            ),
        )


@asset(
    key=[DEMO_GROUP, "moe_student"],
    group_name=DEMO_GROUP,
    kinds={"pytorch"},
    code_version=MOE_RECIPE_HASH,
    description="Demo mixture-of-experts student base (a real Qwen3-MoE checkpoint: 4 routed experts, top-2).",
)
def demo_moe_student(context: AssetExecutionContext, storage: ArtifactStore):
    r, path = stage.moe_student(storage.store(), context.log.info)
    return Output(
        {"key": r["recipe_hash"], "path": str(path)},
        metadata=for_people(
            {
                "path": MetadataValue.path(str(path)),
                **built(r["cached"], r["build_seconds"]),
                "exact_match_on_task": r["exact_match"],
                "copy_exact_match": r["copy_exact_match"],
                "parameters": r["parameters"],
                "num_experts": r["num_experts"],
                "num_experts_per_tok": r["num_experts_per_tok"],
            }
        ),
    )


@asset(
    key=[DEMO_GROUP, "teacher_bpe"],
    group_name=DEMO_GROUP,
    kinds={"pytorch"},
    code_version=XTOK_RECIPE_HASH,
    description="Demo cipher teacher with a byte-level BPE tokenizer (another tokenizer than the student's: "
    "cross-tokenizer logit distillation), a real Llama checkpoint.",
)
def demo_xtok_teacher(context: AssetExecutionContext, storage: ArtifactStore):
    r, path = stage.xtok_teacher(storage.store(), context.log.info)
    return Output(
        {"key": r["recipe_hash"], "path": str(path)},
        metadata=for_people(
            {
                "path": MetadataValue.path(str(path)),
                **built(r["cached"], r["build_seconds"]),
                "exact_match_on_task": r["exact_match"],
                "vocab_size": r["vocab_size"],
                "parameters": r["parameters"],
            }
        ),
    )


ASSETS = [demo_models, demo_moe_student, demo_xtok_teacher]  # what the code location loads
