"""promoted_model: the candidate adapter published as the campaign's current model, only when
its own gate said GO (checked here too, so a stale or foreign evaluation can never promote)."""

import json
import os
import shutil
import time

from dagster import AssetExecutionContext, AssetIn, Failure, MetadataValue, Output, asset

from assets.common import key
from campaigns.spec import CampaignSpec
from resources.storage import ArtifactStore


def build(spec: CampaignSpec):
    @asset(key=key(spec, "promoted_model"), group_name=spec.name, kinds={"pytorch"},
           ins={"evaluation": AssetIn(key(spec, "evaluation")), "adapter": AssetIn(key(spec, "student_adapter"))},
           description="The adapter that passed the gate, copied to the campaign's promoted location.")
    def promoted_model(context: AssetExecutionContext, evaluation: dict, adapter: dict, storage: ArtifactStore) -> Output[dict]:
        if evaluation["candidate_key"] != adapter["key"]:
            raise Failure(f"the latest evaluation scored candidate {evaluation['candidate_key']}, not the current adapter "
                          f"{adapter['key']}; re-materialize evaluation first")
        if evaluation["verdict"] != "GO":
            raise Failure(f"gate verdict for candidate {adapter['key']} is {evaluation['verdict']}: not promoting")
        dest = storage.campaign_dir(spec.name) / "promoted_model" / adapter["key"]
        if not (dest / "promotion.json").exists():
            tmp = dest.with_name(dest.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(adapter["adapter_path"], tmp / "adapter")
            record = {"candidate_key": adapter["key"], "base_model_path": adapter["base_model_path"],
                      "verdict": evaluation["verdict"], "scores": evaluation["scores"],
                      "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "run_id": context.run_id}
            (tmp / "promotion.json").write_text(json.dumps(record, indent=2))
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
        current = storage.campaign_dir(spec.name) / "promoted_model" / "CURRENT"
        current.write_text(adapter["key"])
        record = json.loads((dest / "promotion.json").read_text())
        manifest = {"key": adapter["key"], "path": str(dest), "adapter_path": str(dest / "adapter"), **record}
        return Output(manifest, metadata={"adapter": MetadataValue.path(str(dest / "adapter")),
                                          "candidate_key": adapter["key"], "verdict": record["verdict"],
                                          "promoted_at": record["promoted_at"]})

    return promoted_model
