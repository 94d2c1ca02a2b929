"""The trainer on the real model, SmolLM2-135M-Instruct: QLoRA (bitsandbytes NF4 on CPU) for a few
steps on a chat-template dataset built by the dataset stage; the resolved dtype and the
reproducibility card travel with the adapter, with the tokenizer, chat template and stop ids."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

NOUNS = ["cat", "dog", "book", "tree"]  # one pair per row, each seen twice in 4 steps of 2


def test_qlora_steps_on_the_real_model_lower_the_loss_and_the_adapter_loads(smollm2, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from campaign_orchestrator.dataset.tokenize import BuildSettings, build_tokenized_dataset
    from tests.support.train_support import make_job
    from training.recipes import run

    src = tmp_path / "pairs.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"id": n, "prompt": f"Plural of {n}?", "completion": n + "s"} for n in NOUNS]), src
    )
    report = build_tokenized_dataset(smollm2, [src], tmp_path / "ds", BuildSettings(max_seq_len=64, num_proc=1))
    assert report["template"] == "chat" and report["stop_token"]["passed"]
    job = make_job(
        tmp_path / "out",
        smollm2,
        tmp_path / "ds" / "train",
        student={
            "quantization": {"load_in_4bit": True, "compute_dtype": "auto"},
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
        },
        max_steps=4,
        micro_batch_size=2,
        learning_rate=3e-3,
        warmup_steps=0,
        log_every=1,
        max_seq_len=64,
        eval_rows=0,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in zip(
        ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
        ("0", "0", "1", "1", "127.0.0.1", str(port)),
        strict=False,
    ):
        monkeypatch.setenv(k, v)
    Path(job.output_dir).mkdir(parents=True)
    summary = run(job.write(tmp_path / "job.json"))
    losses = [r["loss"] for r in pq.read_table(tmp_path / "out" / "metrics.parquet").to_pylist()]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert summary["compute_dtype"] in ("float32", "bfloat16") and summary["compute_dtype_requested"] == "auto"

    adapter = Path(summary["adapter_dir"])
    card = json.loads((adapter / "reproducibility.json").read_text())
    assert card["compute_dtype"]["dtype"] == summary["compute_dtype"] and card["seed"] == job.training.seed
    assert {"torch", "transformers", "peft", "bitsandbytes"} <= set(card["libraries"])
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (adapter / name).exists(), name  # the tokenizer, chat template and stop ids travel with it

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32), str(adapter)
    )
    tok = AutoTokenizer.from_pretrained(str(adapter))
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        out = model(**tok("Plural of cat?", return_tensors="pt"))
    assert torch.isfinite(out.logits).all()
