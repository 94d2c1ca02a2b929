"""The blocking decontamination check on distillation_set, through Dagster: training prompts that are
also gate documents (the held-out suite's and the shipped harness tasks') are dropped and counted, or
the check fails and training never starts."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dagster import materialize

from assets import distillation_set, prompts, teacher_generations, tokenized_dataset
from assets.location import default_resources
from campaign_orchestrator.demo import cipher
from campaigns.loader import parse_campaign_text
from tests.support.harness_support import TASKS, task_docs

pytestmark = pytest.mark.stage


def _campaign(source: Path, action: str) -> str:
    return f"""
name: decon_{action}
teacher: {{backend: transformers, model: "@demo/teacher", sampling: {{max_new_tokens: 16}}, batch_size: 64,
  hardware: cpu-2vcpu}}
student: {{base_model: "@demo/student", quantization: {{load_in_4bit: false, compute_dtype: float32}}}}
data:
  source: "{source}"
  heldout: {{fraction: 0.2, seed: 0}}
  decontamination: {{action: {action}, ngram: 13}}
training: {{max_steps: 1, max_seq_len: 64, hardware: cpu-2vcpu}}
evaluation:
  suites:
    - {{name: cipher}}
    - {{name: harness_cipher, kind: lm_eval, lm_eval: {{tasks: [cipher], include_path: "{TASKS}"}}}}
"""


def _run(spec, root: Path):
    return materialize(
        [
            prompts.build(spec),
            teacher_generations.build(spec),
            distillation_set.build(spec),
            tokenized_dataset.build(spec),
        ],
        resources=default_resources(str(root)),
        raise_on_error=False,
    )


def test_training_data_overlapping_gate_documents_is_dropped_or_blocks(tmp_path, artifact_root):
    leaked = [d["prompt"] for d in task_docs("cipher_gen")[:6]] + [d["prompt"] for d in task_docs("cipher_mc")[:4]]
    rows = cipher.items(80, seed=31)
    rows += [
        {"id": f"leak{i}", "prompt": p, "reference": cipher.encode(p.split()[1]), "category": "short"}
        for i, p in enumerate(leaked)
    ]
    src = cipher.write_jsonl(rows, tmp_path / "prompts.jsonl")

    spec = parse_campaign_text(_campaign(src, "fail"), str(tmp_path / "decon_fail.yaml"))
    result = _run(spec, artifact_root)
    check = [e for e in result.get_asset_check_evaluations() if e.check_name == "decontamination"][-1]
    assert not check.passed
    assert not result.asset_materializations_for_node("decon_fail__tokenized_dataset")  # training never gets data

    # the independent count: training prompts equal to a gate document (the documents are shorter than
    # 13 tokens, so they match whole; a one-word teacher output cannot hold a two-word document)
    m = next(e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == "prompts")
    meta = m.event_specific_data.materialization.metadata
    root = Path(meta["path"].value)
    train = pq.read_table(root / "train.parquet").to_pylist()
    held = {r["prompt"] for r in pq.read_table(root / "heldout.parquet").to_pylist()}
    gate = held | {d["prompt"] for d in task_docs("cipher_gen") + task_docs("cipher_mc")}
    expected = sorted(r["id"] for r in train if r["prompt"] in gate)
    assert len(expected) >= 5  # most leaked prompts landed in the training split
    md = check.metadata
    assert md["contaminated_rows"].value == len(expected) and md["action"].value == "fail"
    suites = md["suites"].value
    assert set(suites) == {"cipher", "harness_cipher/cipher_gen", "harness_cipher/cipher_mc"}
    assert suites["harness_cipher/cipher_gen"]["documents_checked"] == 60
    assert suites["cipher"]["training_rows_overlapping"] == 0  # the split keeps ids apart; the data has no repeats
    assert "nothing downstream runs" in check.description

    spec = parse_campaign_text(_campaign(src, "drop"), str(tmp_path / "decon_drop.yaml"))
    result = _run(spec, artifact_root)
    assert result.success
    check = [e for e in result.get_asset_check_evaluations() if e.check_name == "decontamination"][-1]
    assert check.passed and check.metadata["contaminated_rows"].value == len(expected)
    dist = next(e for e in result.get_asset_materialization_events() if e.asset_key.path[-1] == "distillation_set")
    dmeta = {k: v.value for k, v in dist.event_specific_data.materialization.metadata.items()}
    assert dmeta["dropped_contaminated"] == len(expected)
    kept = pq.read_table(Path(dmeta["path"]) / "distillation.parquet").to_pylist()
    assert not {r["prompt"] for r in kept} & gate
    assert len(kept) == dmeta["input_rows"] - sum(
        v for k, v in dmeta.items() if k.startswith("dropped_") and k != "dropped_contaminated"
    ) - len(expected)
