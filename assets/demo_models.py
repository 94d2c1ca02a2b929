"""demo_models: the tiny teacher and student base built from a seed (cached by recipe hash).

One multi-asset, subsettable: both models come out of one build (one tokenizer trained once, one
cache directory with one ``_SUCCESS`` marker per recipe hash), so they stay one computation, but a
campaign job may select only the model it reads (``@demo/student`` with an API teacher selects
``demo_models/student`` alone). A materialization reports only the selected models.
"""

from dagster import AssetExecutionContext, AssetOut, MetadataValue, Output, multi_asset

from assets.common import DEMO_GROUP
from resources.storage import ArtifactStore
from campaign_orchestrator.demo.recipe import recipe_hash

NAMES = ("teacher", "student")


@multi_asset(
    outs={name: AssetOut(key=[DEMO_GROUP, name], group_name=DEMO_GROUP, kinds={"pytorch"}, is_required=False,
                         description=f"Demo {name} model (demo recipe), a real Llama checkpoint on disk.")
          for name in NAMES},
    code_version=recipe_hash(),
    can_subset=True,
)
def demo_models(context: AssetExecutionContext, storage: ArtifactStore):
    from campaign_orchestrator.demo.recipe import cached_report, models_dir

    report = cached_report(storage.root_path())
    if report is None:  # build them (imports torch; a built set is only read)
        from campaign_orchestrator.demo.build import build_demo_models

        report = build_demo_models(storage.root_path(), log=context.log.info)
    root = models_dir(storage.root_path())
    for name in NAMES:
        if name not in context.op_execution_context.selected_output_names:
            continue
        r = report[name]
        yield Output({"key": report["recipe_hash"], "path": str(root / name)}, output_name=name, metadata={
            "path": MetadataValue.path(str(root / name)), "exact_match_on_task": r["exact_match"],
            "parameters": r["parameters"], "train_seconds": r["train_seconds"], "cached": report["cached"],
            "build_seconds": report["build_seconds"]})
