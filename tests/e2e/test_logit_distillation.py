"""Logit distillation end to end through Dagster on a shrunken demo: the teacher stores its top-k
log-probabilities, the dataset stage places them on the packed rows, and the trainer's KL term is
real (finite, covering the completion tokens, and falling as the student learns the cipher)."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from dagster import AssetKey, DagsterInstance

from assets.location import build_definitions, campaign_job_name
from campaign_orchestrator.demo import cipher
from tests.support import REPO_ROOT as REPO

pytestmark = pytest.mark.slow

STAGES = ("prompts", "teacher_generations", "distillation_set", "tokenized_dataset", "student_adapter")


def _metadata(result, key: AssetKey) -> dict:
    mats = result.asset_materializations_for_node(key.to_python_identifier())
    assert mats, f"no materialization of {key.to_user_string()}"
    return {k: v.value for k, v in mats[-1].metadata.items()}


def test_logit_distillation_trains_on_the_teachers_top_k(tmp_path, artifact_root):
    name = "mini_logits"
    spec = yaml.safe_load((REPO / "campaigns" / "demo.yaml").read_text())
    data = tmp_path / "prompts.jsonl"
    cipher.write_jsonl(cipher.items(160, seed=5), data)
    spec["name"] = name
    spec.pop("schedule", None)
    spec["data"]["source"] = str(data)
    spec["data"]["heldout"] = {"fraction": 0.1, "seed": 0}
    spec["teacher"]["sampling"]["logprobs"] = 4
    spec["evaluation"]["suites"] = [x for x in spec["evaluation"]["suites"] if x.get("kind") != "lm_eval"]
    spec["training"].update(
        {
            "max_steps": 30,
            "log_every": 10,
            "micro_batch_size": 8,
            "eval_rows": 16,
            "distillation": {"loss": "logits", "kl_weight": 0.5},
        }
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))

    defs = build_definitions([str(path)], artifact_root=str(artifact_root))
    job = defs.resolve_job_def(campaign_job_name(name))
    result = job.execute_in_process(
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
        asset_selection=[AssetKey([name, s]) for s in STAGES],
    )
    assert result.success

    tok = _metadata(result, AssetKey([name, "tokenized_dataset"]))
    assert tok["teacher_topk_k"] == 4
    examples = tok["teacher_topk_examples"]
    assert examples["aligned"] == tok["examples_out"] > 100  # every kept example carries the teacher's lists
    assert tok["teacher_topk_positions"] == tok["loss_tokens"]  # ... on each of its completion tokens and EOS

    train = _metadata(result, AssetKey([name, "student_adapter"]))
    assert train["loss_kind"] == "logits"
    metrics = pq.read_table(Path(str(train["metrics"]))).to_pylist()
    kl = [m["kl_loss"] for m in metrics]
    ce = [m["ce_loss"] for m in metrics]
    assert len(kl) == 30 and all(x is not None and math.isfinite(x) and x >= 0 for x in kl)
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    assert first > 1.0 and last < first / 2, kl  # the student moves towards the teacher's distribution
    assert sum(ce[-3:]) / 3 < sum(ce[:3]) / 3
    for m in metrics:  # the logged loss is the mix of the two terms, each per its own tokens
        assert m["loss"] == pytest.approx(0.5 * m["ce_loss"] + 0.5 * m["kl_loss"], rel=1e-5)
