"""Model references: one resolver for demo models, directories, GGUF files, packaged models, S3 and hub ids."""

from __future__ import annotations

import json

import pytest

from campaign_orchestrator import models
from campaign_orchestrator.models import ModelNotFound


def test_kinds(tmp_path):
    (tmp_path / "ckpt").mkdir()
    assert models.parse("@demo/student", tmp_path).kind == "demo"
    assert models.parse("@packaged/smollm2-135m-instruct", tmp_path).kind == "packaged"
    assert models.parse("s3://bucket/models/x", tmp_path).kind == "s3"
    assert models.parse("ckpt", tmp_path, base=tmp_path).kind == "dir"
    assert models.parse("weights/m.gguf", tmp_path, base=tmp_path).kind == "gguf"
    assert models.parse("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path, base=tmp_path).kind == "hub"
    assert models.parse("./not/there", tmp_path, base=tmp_path).kind == "dir"  # an explicit path is never a hub id


def test_a_hub_id_offline_is_a_clear_error_naming_the_model_and_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound) as e:
        models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path, base=tmp_path, revision="main")
    msg = str(e.value)
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in msg and "HF_HUB_OFFLINE" in msg and "--local-dir" in msg
    with pytest.raises(ModelNotFound, match="has no `revision`: pin one"):
        models.resolve("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path, base=tmp_path)


def test_a_hub_id_without_a_route_to_the_hub_is_the_same_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    with pytest.raises(ModelNotFound, match="the Hugging Face hub could not provide it"):
        models.resolve("org/model", tmp_path, base=tmp_path, revision="abc123")


def test_missing_things_say_what_to_give(tmp_path):
    with pytest.raises(ModelNotFound, match="not built yet.*campaign build-models"):
        models.resolve("@demo/student", tmp_path)
    with pytest.raises(ModelNotFound, match="unknown packaged model"):
        models.resolve("@packaged/nope", tmp_path)
    with pytest.raises(ModelNotFound, match="GGUF file"):
        models.resolve("m.gguf", tmp_path, base=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="no config.json"):
        models.resolve("empty", tmp_path, base=tmp_path)
    with pytest.raises(ModelNotFound, match="give a checkpoint directory, a .gguf file"):
        models.resolve("./nowhere", tmp_path, base=tmp_path)


def test_s3_prefix_is_downloaded_once_and_again_when_it_changes(tmp_path, s3):
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="m/config.json", Body=json.dumps({"model_type": "llama"}).encode())
    s3.put_object(Bucket="models", Key="m/tok/tokenizer.json", Body=b"{}")
    first = models.resolve("s3://models/m", tmp_path)
    assert json.loads((first / "config.json").read_text()) == {"model_type": "llama"}
    assert (first / "tok" / "tokenizer.json").exists() and (first / models.COMPLETE).exists()
    assert models.resolve("s3://models/m", tmp_path) == first
    s3.put_object(Bucket="models", Key="m/config.json", Body=json.dumps({"model_type": "qwen2"}).encode())
    second = models.resolve("s3://models/m", tmp_path)
    assert second != first and json.loads((second / "config.json").read_text())["model_type"] == "qwen2"


def test_identity_never_downloads_and_hashes_a_gguf_file(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    ident = models.identity("m.gguf", base=tmp_path)
    assert ident["kind"] == "gguf" and len(ident["gguf_sha256"]) == 64
    assert models.identity("org/name", base=tmp_path, revision="r1") == {
        "ref": "org/name",
        "revision": "r1",
        "kind": "hub",
    }
