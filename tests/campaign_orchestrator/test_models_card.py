"""Say what the real model is: a model converted from GGUF carries a card (source package and file, sha256,
quantization, dequantized to fp32) that `campaign fetch-model` prints and the adapter's reproducibility card
includes. A tiny GGUF written here stands in for the shipped one (nothing is downloaded)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from campaign_app.cli.models import fetch_model_command
from campaign_orchestrator import models
from campaign_orchestrator.content import file_sha256
from campaign_orchestrator.hardware import Resolved
from training.summary import REPRODUCIBILITY, write_reproducibility_card


def _tiny_gguf(path: Path, file_type) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(int(file_type))
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def packaged_q4(tmp_path, monkeypatch) -> Path:
    """A Q4_1-typed GGUF registered as a packaged model (by its sha256, as the shipped one is)."""
    import gguf

    f = _tiny_gguf(tmp_path / "Tiny.Q4_1.gguf", gguf.LlamaFileType.MOSTLY_Q4_1)
    pm = models.PackagedModel(
        "llm-tiny==0.0.1", "llm_tiny/Tiny.Q4_1.gguf", file_sha256(f), "Apache-2.0", "Tiny (test)", hub_id="org/tiny"
    )
    monkeypatch.setitem(models.PACKAGED, "tiny", pm)
    return f


def test_the_card_records_the_package_file_sha256_and_that_q4_1_was_dequantized_to_fp32(packaged_q4, tmp_path):
    out = tmp_path / "converted"
    out.mkdir()
    card = models.write_model_card(out, packaged_q4)
    assert models.read_model_card(out) == card and [p.name for p in tmp_path.iterdir() if "card" in p.name] == []
    assert card["source"] == {
        "kind": "packaged",
        "ref": "@packaged/tiny",
        "package": "llm-tiny==0.0.1",
        "index": "PyPI",
        "file": "llm_tiny/Tiny.Q4_1.gguf",
        "license": "Apache-2.0",
        "about": "Tiny (test)",
        "hub_id": "org/tiny",  # the release it was made from: the promoted adapter's card names it as its base
        "sha256": file_sha256(packaged_q4),
    }
    assert models.hub_id(str(out), card=card) == models.hub_id("@packaged/tiny") == "org/tiny"
    assert models.hub_id("@demo/student") is None and models.hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert card["quantization"] == "Q4_1" and card["gguf_file_type"] == "MOSTLY_Q4_1"
    assert card["conversion"]["dtype"] == "float32" and card["conversion"]["dequantized"] is True
    assert "Q4_1 weights were dequantized to float32" in card["conversion"]["note"]


def test_an_unpackaged_fp32_gguf_is_named_by_its_file_and_not_dequantized(tmp_path):
    import gguf

    f = _tiny_gguf(tmp_path / "mine.gguf", gguf.LlamaFileType.ALL_F32)
    card = models.model_card(f)
    assert card["source"] == {"kind": "gguf", "file": "mine.gguf", "sha256": file_sha256(f)}
    assert card["conversion"]["dequantized"] is False and card["gguf_tensor_types"] == {"F32": 1}
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    assert models.model_card(junk)["quantization"] is None  # unreadable: says what is known, never raises


def test_a_cached_conversion_without_a_card_gets_one_and_fetch_model_prints_it(
    packaged_q4, tmp_path, monkeypatch, capsys
):
    cache = tmp_path / "gguf"
    key = models.short(
        models.value_sha256({"gguf": file_sha256(packaged_q4), "converter": models.CONVERTER_VERSION}), 16
    )
    (cache / key).mkdir(parents=True)
    (cache / key / models.COMPLETE).write_text("")  # converted before model cards existed
    assert models.convert_gguf(packaged_q4, cache) == cache / key  # no re-conversion (torch never loads here)
    assert models.read_model_card(cache / key)["quantization"] == "Q4_1"
    monkeypatch.setattr(models, "resolve", lambda *a, **k: cache / key)
    assert fetch_model_command(argparse.Namespace(model="tiny", artifacts=str(tmp_path), revision=None)) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == str(cache / key)  # the directory first, as before
    printed = json.loads(out.split(":\n", 1)[1])
    assert printed["source"]["package"] == "llm-tiny==0.0.1" and printed["conversion"]["dequantized"] is True


def test_the_adapters_reproducibility_card_includes_the_base_models_card(packaged_q4, tmp_path):
    import torch

    base = tmp_path / "base"
    base.mkdir()
    models.write_model_card(base, packaged_q4)
    spec = SimpleNamespace(
        seed=0, nodes=1, processes_per_node=1, sharding="none", micro_batch_size=1, gradient_accumulation_steps=1
    )
    trainer = SimpleNamespace(
        spec=spec,
        precision=Resolved("auto", "float32", "cpu", "test"),
        attn_implementation="eager",
        allocator="system",
        device=torch.device("cpu"),
        world=1,
        total_steps=1,
        job=SimpleNamespace(base_model_path=str(base), dataset_path="d"),
    )
    card = write_reproducibility_card(trainer, tmp_path)
    assert json.loads((tmp_path / REPRODUCIBILITY).read_text())["base_model_card"] == card["base_model_card"]
    assert card["base_model_card"]["source"]["package"] == "llm-tiny==0.0.1"
    assert card["base_model_card"]["quantization"] == "Q4_1"
    trainer.job.base_model_path = str(tmp_path / "plain")  # a plain checkpoint: no card, said as null
    assert write_reproducibility_card(trainer, tmp_path)["base_model_card"] is None
