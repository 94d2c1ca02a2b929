"""The tokenized dataset's blocking checks: the stop token is trained; teacher and student vocabularies match."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from campaign_orchestrator.dataset import formatting
from campaign_orchestrator.dataset.checks import last_label_tokens, stop_token_report, vocabulary_report
from tests.campaign_orchestrator.dataset.test_tokenize import pairs

EOS = 2


def table(rows):
    return pa.Table.from_pylist(
        rows, schema=pa.schema([("id", pa.string()), ("labels", pa.list_(pa.int32())), ("status", pa.string())])
    )


def test_last_labelled_token_of_every_row():
    labels = pa.array([[-100, 5, EOS], [-100, 5, EOS, -100], [-100, -100], [], [7]], pa.list_(pa.int32()))
    assert last_label_tokens(labels).tolist() == [EOS, EOS, -100, -100, 7]


def test_a_mask_cut_before_the_stop_token_fails_and_truncated_rows_are_counted_apart():
    good = {"id": "g", "labels": [-100, 4, 5, EOS, -100], "status": "ok"}
    cut = {"id": "cut", "labels": [-100, 4, 5, -100], "status": "ok"}
    trunc = {"id": "t", "labels": [-100, 4, 5], "status": "truncated"}
    r = stop_token_report(table([good, good | {"id": "g2"}, trunc]), [EOS])
    assert r["passed"] and r["truncated_without_stop"] == 1 and r["ends_on_stop_token"] == 2
    r = stop_token_report(table([good, cut, trunc]), [EOS])
    assert not r["passed"] and r["missing"] == 1 and r["missing_examples"] == ["cut"]


def _materialize(spec, artifact_root, tmp_path, rows, dist_key="dist-1"):
    from dagster import AssetSpec, materialize

    from assets import tokenized_dataset as tokenized
    from assets.common import key
    from assets.io_manager import ManifestIOManager
    from resources.storage import ArtifactStore

    src = tmp_path / f"{dist_key}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    pointer = artifact_root / spec.name / "distillation_set" / "LATEST.json"
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_text(json.dumps({"key": dist_key, "distillation_path": str(src)}))
    res = materialize(
        [AssetSpec(key(spec, "distillation_set")), tokenized.build(spec)],
        raise_on_error=False,
        resources={
            "storage": ArtifactStore(root=str(artifact_root)),
            "io_manager": ManifestIOManager(root=str(artifact_root)),
        },
        selection=[key(spec, "tokenized_dataset")],
    )
    return {e.check_name: e for e in res.get_asset_check_evaluations()}


def test_the_asset_check_blocks_a_dataset_whose_mask_ends_before_the_stop_token(artifact_root, tmp_path, monkeypatch):
    from campaigns.loader import load_campaigns

    spec = load_campaigns(["campaigns/demo.yaml"]).campaigns["demo"]
    checks = _materialize(spec, artifact_root, tmp_path, pairs(60))
    assert checks["stop_token_trained"].passed
    assert "end without" not in checks["stop_token_trained"].description

    real = formatting.encode_batch_arrow

    def eos_masked(batch, tok, template, settings, teacher=None):  # the classic bug: pad == EOS, masked with it
        out = real(batch, tok, template, settings, teacher)
        labels = [
            [formatting.IGNORE if i == template.eos_id else lab for i, lab in zip(ids, labs, strict=False)]
            for ids, labs in zip(out.column("input_ids").to_pylist(), out.column("labels").to_pylist(), strict=False)
        ]
        return out.set_column(out.schema.get_field_index("labels"), "labels", pa.array(labels, pa.list_(pa.int32())))

    monkeypatch.setattr(formatting, "encode_batch_arrow", eos_masked)
    broken = spec.model_copy(update={"dataset": spec.dataset.model_copy(update={"num_proc": 1})})
    checks = _materialize(broken, artifact_root, tmp_path, pairs(60, prefix="b"), dist_key="dist-2")
    ev = checks["stop_token_trained"]
    assert not ev.passed and "would not learn to stop" in ev.description
    assert ev.metadata["missing"].value == 60


def test_vocabularies(demo_models, tmp_path):
    import shutil

    same = vocabulary_report(demo_models["student"], demo_models["student"])
    assert same["passed"] and not same["reasons"]
    other = vocabulary_report(demo_models["teacher"], demo_models["student"])
    assert other["passed"]  # the demo models share one tokenizer and vocabulary
    padded = tmp_path / "padded"
    shutil.copytree(demo_models["teacher"], padded)
    cfg = json.loads((padded / "config.json").read_text())
    n = cfg["vocab_size"]
    cfg["vocab_size"] = n + 64 - n % 64  # Qwen-style: embeddings padded to a multiple of 64
    (padded / "config.json").write_text(json.dumps(cfg))
    r = vocabulary_report(padded, demo_models["student"])
    assert not r["passed"] and f"teacher {cfg['vocab_size']:,}, student {n:,}" in r["reasons"][0]
