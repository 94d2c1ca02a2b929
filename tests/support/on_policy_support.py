"""On-policy training jobs on the demo models (tests/training/test_on_policy_train.py): cipher prompts, the demo
teacher in process, the demo student."""

from __future__ import annotations

import random
from pathlib import Path


def write_cipher_prompts(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` cipher prompts in the prompts stage's table (id, prompt, reference, category, source_file)."""
    from campaign_orchestrator.dataset.prompts import write_prompts
    from campaign_orchestrator.demo import cipher

    rng = random.Random(seed)
    gen = cipher.pairs(rng, cipher.CIPHER)
    rows = []
    for i in range(n):
        p, c = next(gen)
        rows.append(
            {"id": f"p{i:04d}", "prompt": p, "reference": c.strip(), "category": "cipher", "source_file": "test"}
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_prompts(rows, path)


def on_policy_job(
    out: Path, demo_models: dict, prompts: Path, dataset: Path | str = "", on_policy: dict | None = None, **training
):
    """A fully on-policy job (no tokenized dataset unless ``dataset``) with the demo teacher scoring in process."""
    from tests.support.train_support import make_job
    from training.config import OnPolicyJob

    op = {
        "samples_per_round": 8,
        "top_k": 8,
        "max_new_tokens": 10,
        "temperature": 1.0,
        "teacher_generations": "none" if not dataset else "generate",
    } | (on_policy or {})
    fields = {
        "max_steps": 8,
        "micro_batch_size": 2,
        "learning_rate": 5e-3,
        "warmup_steps": 1,
        "eval_rows": 0,
        "checkpoint": {"every_steps": None, "every_minutes": None},
    } | training
    fields["distillation"] = {"loss": "on_policy", "on_policy": op}
    job = make_job(
        out,
        demo_models["student"],
        dataset,
        student={"quantization": {"load_in_4bit": False, "compute_dtype": "float32"}, "attn_implementation": "eager"},
        **fields,
    )
    return job.model_copy(
        update={
            "teacher_tokenizer_path": str(demo_models["teacher"]),
            "on_policy": OnPolicyJob(
                prompts_path=str(prompts),
                teacher_backend="transformers",
                teacher_model_path=str(demo_models["teacher"]),
                teacher_compute_dtype="float32",
                teacher_identity="demo-teacher",
            ),
        }
    )
