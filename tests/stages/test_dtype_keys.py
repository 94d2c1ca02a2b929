"""Caches keyed by what ran: the resolved compute dtype and device kind (never ``auto``) are part of the
teacher identity (so of the generation stage key and the generation cache's namespace), the adapter key and
the evaluation key. The same campaign on a CPU with native bf16 and on one without shares none of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dagster import materialize

from assets import prompts as prompts_asset
from assets import teacher_generations as generations
from assets.location import default_resources
from campaign_orchestrator import hardware
from campaign_orchestrator.content import value_sha256
from campaign_orchestrator.demo import cipher
from campaign_orchestrator.generation.backends import spec_identity, teacher_identity
from campaign_orchestrator.generation.requests import Sampling, namespace
from campaign_orchestrator.hardware import CpuPeak, key_precision
from campaigns.loader import parse_campaign_text
from stages.errors import StageError
from stages.evaluation import local_quantization_key
from stages.student_adapter import adapter_precision, adopt_trial, check_precision, training_key_fields

BF16_NATIVE = CpuPeak(host="h", capability="AVX512", threads=2, torch="x", fp32_gflops=150.0, bf16_gflops=300.0)
NO_BF16 = CpuPeak(host="h", capability="AVX2", threads=2, torch="x", fp32_gflops=150.0, bf16_gflops=0.3)


@pytest.fixture
def host(monkeypatch):
    """Pick the CPU the campaign runs on: ``host("bf16")`` or ``host("fp32")`` (no GPU either way)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def use(kind: str) -> None:
        peak = BF16_NATIVE if kind == "bf16" else NO_BF16
        monkeypatch.setattr(hardware, "measure_cpu_peak", lambda refresh=False: peak)

    return use


def _spec(source: str = "prompts.jsonl", launcher: str = "local", dtype: str = "auto"):
    return parse_campaign_text(f"""
name: dtkeys
teacher:
  backend: transformers
  model: "@demo/teacher"
  compute_dtype: auto
  sampling: {{max_new_tokens: 6}}
  batch_size: 8
  hardware: cpu-2vcpu
student:
  base_model: "@demo/student"
  quantization: {{load_in_4bit: false, compute_dtype: {dtype}}}
data:
  source: "{source}"
  heldout: {{fraction: 0.25}}
training: {{max_steps: 1, hardware: cpu-2vcpu, launcher: {launcher}}}
{"kubernetes: {image: trainer:1, namespace: ns}" if launcher == "k8s" else ""}
evaluation: {{suites: [{{name: cipher}}]}}
""")


def test_key_precision_is_the_resolved_dtype_and_device_never_auto(host, monkeypatch):
    host("bf16")
    assert key_precision("auto") == "cpu:bfloat16"
    assert key_precision("float32") == "cpu:float32"
    host("fp32")
    assert key_precision("auto") == "cpu:float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert key_precision("auto", "cuda:1") == "cuda:bfloat16"
    assert key_precision("float32", "cuda") != key_precision("float32", "cpu")  # same dtype, another device


def test_the_four_keys_differ_between_a_bf16_and_an_fp32_host_and_hold_no_auto(host):
    spec = _spec()
    sampling = Sampling.from_spec(spec.teacher.sampling)
    got = {}
    for kind in ("bf16", "fp32"):
        host(kind)
        ident = spec_identity(spec.teacher, weights_id="w@")
        adapter = training_key_fields(spec, adapter_precision(spec))
        got[kind] = {
            "teacher": ident,
            "namespace": namespace(ident, sampling),
            "adapter": value_sha256(adapter),
            "evaluation": value_sha256(local_quantization_key(spec.student.quantization)),
        }
        assert ident.endswith(f"|cpu:{'bfloat16' if kind == 'bf16' else 'float32'}") and "auto" not in ident
        assert adapter["student"]["quantization"]["compute_dtype"] == key_precision("auto")
        assert local_quantization_key(spec.student.quantization)["compute_dtype"] == key_precision("auto")
    assert all(got["bf16"][k] != got["fp32"][k] for k in got["bf16"]), got
    # an explicit dtype resolves to itself on both hosts: one key
    f32 = _spec(dtype="float32")
    keys = []
    for kind in ("bf16", "fp32"):
        host(kind)
        keys.append(value_sha256(training_key_fields(f32, adapter_precision(f32))))
    assert keys[0] == keys[1]
    # endpoints are not keyed by this host's dtype; a precision of `auto` is refused
    openai = parse_campaign_text(_spec().model_dump_json()).teacher.model_copy(
        update={"backend": "openai", "base_url": "http://h/v1", "model": "m"}
    )
    assert spec_identity(openai) == "openai:http://h/v1|m@"
    with pytest.raises(ValueError, match="resolved"):
        teacher_identity("transformers", "m", weights_id="w", precision="cpu:auto")


def test_a_kubernetes_adapter_is_keyed_for_the_clusters_gpus_and_a_mismatch_is_not_stored(host, tmp_path):
    host("fp32")
    k8s = _spec(launcher="k8s")
    assert adapter_precision(k8s) == "cuda:bfloat16"  # where `auto` runs there (the planner assumes it too)
    check_precision(k8s, {"device": "cuda", "compute_dtype": "bfloat16"}, "cuda:bfloat16", tmp_path)
    with pytest.raises(StageError, match="trained in cuda:float16 but its cache key was made for cuda:bfloat16"):
        check_precision(k8s, {"device": "cuda", "compute_dtype": "float16"}, "cuda:bfloat16", tmp_path)
    # a sweep trial trained on another host (another dtype) is not adopted as this host's adapter
    best = tmp_path / "trial"
    (best / "adapter").mkdir(parents=True)
    (best / "adapter" / "adapter_config.json").write_text("{}")
    (best / "metrics.parquet").write_text("")
    (best / "summary.json").write_text(json.dumps({"device": "cpu", "compute_dtype": "bfloat16"}))
    sweep = {"best_dir": str(best), "best_complete": True}
    (tmp_path / "out").mkdir()
    assert adopt_trial(sweep, tmp_path / "out", "cpu:float32") is None
    assert adopt_trial(sweep, tmp_path / "out", "cpu:bfloat16") is not None


def _generations(spec, root: Path) -> dict:
    res = materialize(
        [prompts_asset.build(spec), generations.build(spec)],
        resources=default_resources(str(root)),
        raise_on_error=True,
    )
    mat = res.asset_materializations_for_node("dtkeys__teacher_generations")[-1]
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.mark.stage
def test_the_generation_stage_regenerates_on_a_host_that_resolves_another_dtype(host, tmp_path, artifact_root):
    src = cipher.write_jsonl(cipher.items(8, seed=5, id_prefix="d"), tmp_path / "prompts.jsonl")
    spec = _spec(str(src))
    host("bf16")
    bf16 = _generations(spec, artifact_root)
    host("fp32")
    fp32 = _generations(spec, artifact_root)
    assert bf16["compute_dtype"] == "bfloat16" and fp32["compute_dtype"] == "float32"  # what ran, as keyed
    assert not fp32["reused"] and fp32["content_key"] != bf16["content_key"]  # another stage key
    assert fp32["new_generations"] == bf16["new_generations"] > 0 and fp32["cache_hits"] == 0  # no sample reused
    host("bf16")
    again = _generations(spec, artifact_root)  # back on the bf16 host: its stage again, nothing generated
    assert again["reused"] and again["content_key"] == bf16["content_key"]
