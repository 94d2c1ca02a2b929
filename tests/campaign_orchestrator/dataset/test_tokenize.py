"""The tokenized_dataset build: every source format, metadata, id split, shards, bad input, reuse."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from campaign_orchestrator.dataset.sources import SourceError
from campaign_orchestrator.dataset.tokenize import (
    ROW_SCHEMA,
    BuildSettings,
    TokenizationError,
    build_tokenized_dataset,
    dataset_metadata,
    split_of,
    tokenizer_hash,
)
from campaign_orchestrator.demo import cipher


def pairs(n: int, prefix: str = "e", seed: int = 0) -> list[dict]:
    return [
        {"id": f"{prefix}{i}", "prompt": it["prompt"], "completion": " " + it["reference"]}
        for i, it in enumerate(cipher.items(n, seed=seed))
    ]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sequences(out_dir, split: str = "train") -> dict[str, list[int]]:
    """example id -> its token ids, recovered from the packed rows."""
    got: dict[str, list[int]] = {}
    for f in sorted((out_dir / split).glob("*.parquet")):
        for row in pq.read_table(f).to_pylist():
            pos = np.array(row["position_ids"])
            starts = [*np.flatnonzero(pos == 0).tolist(), len(pos)]
            for k, ex in enumerate(row["example_ids"]):
                got[ex] = row["input_ids"][starts[k] : starts[k + 1]]
    return got


@pytest.fixture(scope="module")
def student(demo_models):
    return demo_models["student"]


def test_every_source_format_gives_the_same_tokens(student, tmp_path):
    import datasets

    rows = pairs(30)
    j = write_jsonl(tmp_path / "a.jsonl", [r | {"id": "j" + r["id"]} for r in rows])
    pa_table = pa.Table.from_pylist([r | {"id": "p" + r["id"]} for r in rows])
    pq.write_table(pa_table, tmp_path / "b.parquet")
    pacsv.write_csv(pa.Table.from_pylist([r | {"id": "c" + r["id"]} for r in rows]), tmp_path / "c.csv")
    datasets.Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]).save_to_disk(
        str(tmp_path / "saved")
    )
    m = write_jsonl(
        tmp_path / "m.jsonl",
        [
            {
                "id": "m" + r["id"],
                "messages": [
                    {"role": "user", "content": r["prompt"]},
                    {"role": "assistant", "content": r["completion"]},
                ],
            }
            for r in rows
        ],
    )
    out = tmp_path / "out"
    report = build_tokenized_dataset(
        student,
        [j, tmp_path / "b.parquet", tmp_path / "c.csv", tmp_path / "saved", m],
        out,
        BuildSettings(max_seq_len=64),
    )
    assert report["examples_in"] == report["examples_out"] == 150 and report["dropped_total"] == 0
    seqs = sequences(out)
    assert len(seqs) == 150
    for i in range(30):  # ids: given, or <source name>:<row> when the source has no id column
        assert seqs[f"je{i}"] == seqs[f"pe{i}"] == seqs[f"ce{i}"] == seqs[f"saved:{i}"] == seqs[f"me{i}"]
    assert report["loss_tokens"] == sum(len(r["completion"]) + 1 for r in rows) * 5  # char tokens + EOS


def test_schema_metadata_split_and_shards(student, tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", pairs(400))
    out = tmp_path / "out"
    settings = BuildSettings(max_seq_len=64, validation_fraction=0.2, split_seed=7, shard_size_bytes=4096)
    report = build_tokenized_dataset(student, [src], out, settings, extra_metadata={"campaign.dataset_key": "k"})
    files = sorted((out / "train").glob("*.parquet"))
    n = len(files)
    assert n > 1 and [f.name for f in files] == [f"train-{i:05d}-of-{n:05d}.parquet" for i in range(n)]
    assert report["shards"] == n + len(list((out / "validation").glob("*.parquet")))
    schema = pq.read_schema(files[0])
    assert schema.remove_metadata().equals(ROW_SCHEMA)
    md = dataset_metadata(files[0])
    assert md["campaign.tokenizer_hash"] == tokenizer_hash(student)
    assert md["campaign.max_seq_len"] == "64" and md["campaign.dataset_key"] == "k"
    assert json.loads(md["campaign.packing"])["packing"] == "bfd" and md["campaign.template"].startswith("plain")
    assert md["campaign.source_hash"] == report["source_hash"] and md["campaign.split_name"] == "train"
    # the split is by example id: the same ids whatever the packing, and an id never changes side
    val = set(sequences(out, "validation"))
    assert val == {r["id"] for r in pairs(400) if split_of(r["id"], 0.2, 7) == "validation"}
    assert 40 < len(val) < 120 and not val & set(sequences(out))
    unpacked = tmp_path / "unpacked"
    r2 = build_tokenized_dataset(
        student, [src], unpacked, BuildSettings(max_seq_len=48, packing=False, validation_fraction=0.2, split_seed=7)
    )
    assert set(sequences(unpacked, "validation")) == val
    assert r2["rows"] == r2["examples_out"] == 400 and report["rows"] < 400
    assert report["packing_efficiency"] > r2["packing_efficiency"]
    assert report["length_histogram"].startswith("| example tokens |")


def test_multiprocess_map_matches_one_process(student, tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", pairs(60))
    one, two = tmp_path / "one", tmp_path / "two"
    build_tokenized_dataset(student, [src], one, BuildSettings(max_seq_len=64, num_proc=1))
    build_tokenized_dataset(student, [src], two, BuildSettings(max_seq_len=64, num_proc=2))
    assert pq.read_table(one / "train").equals(pq.read_table(two / "train"))


def test_bad_rows_are_counted_drops(student, tmp_path):
    rows = pairs(5) + [
        {"id": "missing", "prompt": "encode ab ="},  # no completion
        {"id": "null", "prompt": None, "completion": " q"},
        {"id": "number", "prompt": 12, "completion": " q"},  # non-string content
        {"id": "long", "prompt": "encode " + "a" * 80 + " =", "completion": " b"},
    ]
    src = write_jsonl(tmp_path / "bad.jsonl", rows)
    report = build_tokenized_dataset(student, [src], tmp_path / "out", BuildSettings(max_seq_len=64))
    assert report["examples_in"] == 9 and report["examples_out"] == 5
    assert report["dropped"]["missing_field"] == 2 and report["dropped"]["not_a_string"] == 1
    assert report["dropped"]["too_long"] == 1 and report["dropped_total"] == 4
    cut = build_tokenized_dataset(student, [src], tmp_path / "cut", BuildSettings(max_seq_len=64, too_long="truncate"))
    assert cut["truncated"] == 0 and cut["dropped"]["no_loss_tokens"] == 1  # the cut removed the whole completion


def test_bad_input_is_a_clear_error(student, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SourceError, match="empty.jsonl: the input is empty"):
        build_tokenized_dataset(student, [empty], tmp_path / "o1", BuildSettings(max_seq_len=64))
    pq.write_table(pa.Table.from_pylist(pairs(1)).slice(0, 0), tmp_path / "none.parquet")
    with pytest.raises(SourceError, match="none.parquet: the input is empty"):
        build_tokenized_dataset(student, [tmp_path / "none.parquet"], tmp_path / "o1", BuildSettings(max_seq_len=64))
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [{"id": "a", "question": "x", "answer": "y"}])
    with pytest.raises(SourceError, match=r"wrong.jsonl.*expected columns `prompt` and `completion`"):
        build_tokenized_dataset(student, [wrong], tmp_path / "o2", BuildSettings(max_seq_len=64))
    with pytest.raises(SourceError, match="no files found"):
        build_tokenized_dataset(
            student, [tmp_path / "nope" / "*.jsonl"], tmp_path / "o3", BuildSettings(max_seq_len=64)
        )
    too_long = write_jsonl(tmp_path / "long.jsonl", pairs(3))
    with pytest.raises(TokenizationError, match="raise training.max_seq_len"):
        build_tokenized_dataset(student, [too_long], tmp_path / "o4", BuildSettings(max_seq_len=8))
    dup = write_jsonl(tmp_path / "dup.jsonl", pairs(2) + pairs(1))
    with pytest.raises(TokenizationError, match="'e0' appears more than once"):
        build_tokenized_dataset(student, [dup], tmp_path / "o5", BuildSettings(max_seq_len=64))


def test_asset_is_keyed_by_content_and_consumed_by_the_loader(artifact_root, tmp_path):
    """Materialize tokenized_dataset from a distillation manifest: metadata, no-op rerun, new key
    for a new max length, and the trainer's loader accepts it only for the right tokenizer."""
    from dagster import AssetSpec, materialize

    from assets import tokenized_dataset as tokenized
    from assets.common import key
    from assets.io_manager import ManifestIOManager
    from campaigns.loader import load_campaigns
    from resources.storage import ArtifactStore
    from stages import tokenized_dataset as stage
    from training.data import DatasetMismatch, TokenizedDataset

    spec = load_campaigns(["campaigns/demo.yaml"]).campaigns["demo"]
    src = tmp_path / "distillation.parquet"
    pq.write_table(pa.Table.from_pylist(pairs(120)), src)
    pointer = artifact_root / "demo" / "distillation_set" / "LATEST.json"
    pointer.parent.mkdir(parents=True)
    pointer.write_text(json.dumps({"key": "dist-1", "distillation_path": str(src)}))
    resources = {
        "storage": ArtifactStore(root=str(artifact_root)),
        "io_manager": ManifestIOManager(root=str(artifact_root)),
    }

    def run(s):
        res = materialize(
            [AssetSpec(key(s, "distillation_set")), tokenized.build(s)],
            resources=resources,
            selection=[key(s, "tokenized_dataset")],
        )
        assert res.success
        mat = res.asset_materializations_for_node("demo__tokenized_dataset")[0]
        return {k: v.value for k, v in mat.metadata.items()}

    first = run(spec)
    assert not first["reused"] and first["examples_in"] == 120 and first["rows"] < 120
    assert (
        0 < first["packing_efficiency"] <= 1
        and first["shards"] >= 1
        and "| example tokens |" in first["sequence_lengths"]
    )
    again = run(spec)
    assert again["reused"] and again["content_key"] == first["content_key"]
    longer = spec.model_copy(update={"training": spec.training.model_copy(update={"max_seq_len": 48})})
    other = run(longer)
    assert not other["reused"] and other["content_key"] != first["content_key"]
    settings = stage.build_settings(spec)  # a new tokenizer is a new dataset too
    assert stage.content_key("d", "tok-a", settings, None) != stage.content_key("d", "tok-b", settings, None)
    manifest = json.loads((artifact_root / "demo" / "tokenized_dataset" / "LATEST.json").read_text())
    ds = TokenizedDataset(
        manifest["dataset_path"], cache_dir=tmp_path / "cache", expect_tokenizer_hash=manifest["tokenizer_hash"]
    )
    assert len(ds) == manifest["splits"]["train"]["rows"] and ds.max_seq_len == 48
    with pytest.raises(DatasetMismatch, match="Rebuild the tokenized dataset"):
        TokenizedDataset(manifest["dataset_path"], cache_dir=tmp_path / "cache", expect_tokenizer_hash="0" * 64)
