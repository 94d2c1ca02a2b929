"""demo_models: the tiny teacher and student base built from a seed (cached by recipe hash)."""

from dagster import AssetExecutionContext, AssetOut, MetadataValue, Output, multi_asset

from assets.common import DEMO_GROUP
from resources.storage import ArtifactStore
from campaign_orchestrator.demo.recipe import recipe_hash


@multi_asset(
    outs={name: AssetOut(key=[DEMO_GROUP, name], group_name=DEMO_GROUP, kinds={"pytorch"},
                         description=f"Demo {name} model (demo recipe), a real Llama checkpoint on disk.")
          for name in ("teacher", "student")},
    code_version=recipe_hash(),
)
def demo_models(context: AssetExecutionContext, storage: ArtifactStore):
    from campaign_orchestrator.demo.build import build_demo_models
    from campaign_orchestrator.demo.recipe import models_dir

    report = build_demo_models(storage.root_path(), log=context.log.info)
    root = models_dir(storage.root_path())
    for name in ("teacher", "student"):
        r = report[name]
        yield Output({"key": report["recipe_hash"], "path": str(root / name)}, output_name=name, metadata={
            "path": MetadataValue.path(str(root / name)), "exact_match_on_task": r["exact_match"],
            "parameters": r["parameters"], "train_seconds": r["train_seconds"], "cached": report["cached"],
            "build_seconds": report["build_seconds"]})
