"""The plan prices the step the trainer runs: `campaign plan` and the trainer resolve ``micro_batch_size: auto`` and
``activation_checkpointing: auto`` by one call (costs.memory_policy.resolve_training_policy), each deriving its
inputs by its own path: the planner from the pricing catalog's entry (``campaign plan --json``, as a user runs it),
the trainer from the device it sees (its setup's ``policy_for``, the device's memory mocked) and its job (the policy
terms the student_adapter stage gives it). A TinyLlama-shaped student on GPUs and a Llama-7B-shaped one on CPU hosts
(shapes whose choice depends on the device), at rows of 1024 tokens, on devices of 24, 40, 80 and 141 GB, compile on
and off."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from tests.support import REPO_ROOT

SIZES = (24, 40, 80, 141)
TINYLLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}
# on a CPU (small steps already keep it busy) the choice moves with the memory of a larger model: Llama-7B's shape
LLAMA7B = TINYLLAMA | {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32}
LLAMA7B |= {"num_key_value_heads": 32, "head_dim": 128}


def _catalog(path, kind: str) -> None:
    """Devices of each size: GPUs (gpu-hour), and CPU hosts with the runtime and heap terms of the shipped one."""
    shipped = yaml.safe_load((REPO_ROOT / "campaigns" / "pricing" / "catalog.yaml").read_text())
    perf = dict(shipped["entries"]["h100-sxm" if kind == "cuda" else "cpu-2vcpu"]["perf"])
    perf.pop("host_measured_peak", None)  # plan with the catalog's peak: no host measurement in this test
    price = [{"as_of": "2026-01-01", "usd": 1.0, "source": "test"}]
    unit = "gpu-hour" if kind == "cuda" else "host-hour"
    entries = {f"{kind}-{gb}": {"unit": unit, "memory_gb": gb, "perf": perf, "prices": price} for gb in SIZES}
    entries["cpu-2vcpu"] = shipped["entries"]["cpu-2vcpu"]  # the demo teacher's host
    path.write_text(yaml.safe_dump({"version": "test", "entries": entries}))


def _student(tmp_path, demo_models, config: dict) -> str:
    """A model directory of ``config``'s shape: its config, and the demo student's tokenizer (the planner counts
    prompt tokens with it; nothing loads weights)."""
    d = tmp_path / "tinyllama"
    d.mkdir()
    for f in demo_models["student"].iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy2(f, d / f.name)
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_the_plan_and_the_trainer_resolve_the_same_micro_batch_and_activation_policy(
    kind, tmp_path, demo_models, artifact_root, monkeypatch, capsys
):
    import torch

    from campaign_app import cli
    from campaign_orchestrator import allocator
    from campaign_orchestrator.costs.memory_policy import policy_terms
    from campaigns.loader import load_campaign_file
    from resources.pricing import PricingResource
    from tests.support.campaign_support import demo_teacher, write_campaign
    from training.config import TrainJob
    from training.recipes import lora_finetune

    monkeypatch.setenv(allocator.ENV, "glibc")  # the planner and the trainer's process on one allocator, as launched
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # a GPU where there is none
    _catalog(tmp_path / "catalog.yaml", kind)
    base = _student(tmp_path, demo_models, TINYLLAMA if kind == "cuda" else LLAMA7B)
    seen = set()
    for gb in SIZES:
        for compile_ in (False, True):
            path = write_campaign(tmp_path / "project", f"agree_{kind}_{gb}_{int(compile_)}", demo_teacher())
            spec = yaml.safe_load(path.read_text())
            spec["student"] = {
                "base_model": base,
                "lora": {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                "quantization": {"load_in_4bit": False, "compute_dtype": "bfloat16"},
            }
            spec["training"] |= {
                "micro_batch_size": "auto",
                "activation_checkpointing": "auto",
                "max_seq_len": 1024,
                "compile": compile_,
                "hardware": f"{kind}-{gb}",
            }
            spec["cost"] = {"catalog": str(tmp_path / "catalog.yaml")}
            path.write_text(yaml.safe_dump(spec, sort_keys=False))

            # the planner's side: `campaign plan`, as a user runs it
            assert cli.main(["plan", str(path), "--json", "--artifacts", str(artifact_root)]) == cli.EXIT_OK
            planned = json.loads(capsys.readouterr().out)["memory"]["training_policy"]

            # the trainer's side: its job as the student_adapter stage writes it, its own setup on the device
            loaded = load_campaign_file(path)
            job = TrainJob(
                campaign=loaded.name,
                base_model_path=base,
                dataset_path="",
                output_dir=str(tmp_path / "out"),
                student=loaded.student,
                training=loaded.training,
                policy_terms=policy_terms(loaded, PricingResource().service().catalog_for(loaded)),
            )
            monkeypatch.setattr(lora_finetune, "device_memory_gb", lambda _device, gb=gb: float(gb))
            ran = lora_finetune.LoraFinetuneRecipe(job).policy_for(torch.device(kind)).as_dict()

            case = (kind, gb, compile_)
            assert (ran["micro_batch_size"], ran["activation_policy"]) == (
                planned["micro_batch_size"],
                planned["activation_policy"],
            ), case
            assert ran["compile"] == planned["compile"] == compile_, case
            assert ran["compute_dtype"] == planned["compute_dtype"] == "bfloat16", case
            assert ran["memory"]["fits"] and ran["memory"]["device_memory_gb"] == gb, case
            if compile_:  # the exact cheap recompute is the compiler's under compile: never chosen then
                assert ran["activation_policy"] != "recompute", case
            seen.add((ran["micro_batch_size"], ran["activation_policy"]))
    assert len(seen) > 1  # the devices differ: the test sees the choice move with them
