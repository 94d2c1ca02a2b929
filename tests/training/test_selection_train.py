"""training.selection in the real trainer (demo student, one process): a planted over-trained tail (the held-out
rows contradict what the training rows teach, so held-out loss rises as training goes on) makes the stage return
the best evaluated checkpoint, not the last, with the step and the reason in its summary; patience stops early.

Both run in float32 and in bfloat16 (an AVX2-only host's `auto` and an AVX512-BF16 host's): what they check must
not depend on which one the host picks. The held-out rows are the base's own answers to the training prompts (the
demo student copies the word: `encode hello =` -> ` hello`), so every step that teaches the cipher raises their
loss from the first evaluation on, in either dtype (measured at 5e-2 in both: 3.9-4.0 at step 2, 5.3-5.5 at step
4, 4.9-5.3 at step 8).
They used to be the training prompts with each other's cipher answers, whose loss fell for the 8 or 12 steps these
tests run (the format is learned first) and rose only where the loss diverged at learning rate 5e-2: in bf16 on the
host they were written on, in fp32 on no host (AVX2 hosts failed the patience test), and on an AVX512-BF16 build
host at 039f5fc in neither (both tests failed there in bf16)."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.hosts import DTYPES
from tests.support.train_support import make_job, write_rows

pytestmark = pytest.mark.stage

SMALL = {"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}


def small(dtype: str) -> dict:
    """The small LoRA on the demo's 4-bit student, computing in ``dtype`` (never `auto`)."""
    return SMALL | {"quantization": {"load_in_4bit": True, "compute_dtype": dtype}}


def _datasets(tmp_path, tok_dir):
    """Training rows (cipher pairs) and held-out rows that contradict them: the first 8 training prompts answered
    with the word itself, what the base student says; half of them labelled replay rows."""
    from campaign_orchestrator.demo import cipher

    rng = random.Random(3)
    gen = cipher.pairs(rng, cipher.CIPHER)
    train = [next(gen) for _ in range(24)]
    ds = write_rows(tmp_path / "train", tok_dir, train)
    held = [(p, " " + p.split()[1]) for p, _ in train[:8]]  # "encode hello =" -> " hello"
    val = write_rows(tmp_path / "validation", tok_dir, held)
    f = next(val.glob("*.parquet"))
    t = pq.read_table(f)
    ids = [[f"replay:r{i}"] if i % 2 else [f"r{i}"] for i in range(len(held))]
    t = t.set_column(t.schema.get_field_index("example_ids"), "example_ids", pa.array(ids, pa.list_(pa.string())))
    pq.write_table(t.replace_schema_metadata(pq.read_schema(f).metadata), f)
    return ds, val


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kept_checkpoint_is_the_best_not_the_last(run_job, tmp_path, demo_models, dtype):
    ds, val = _datasets(tmp_path, demo_models["student"])
    job = make_job(
        tmp_path / "out",
        demo_models["student"],
        ds,
        student=small(dtype),
        max_steps=8,
        learning_rate=5e-2,
        micro_batch_size=4,
        warmup_steps=0,
        eval_rows=8,
        selection={"rule": "best_heldout_loss", "every_steps": 2},
    )
    job.validation_path = str(val)
    s = run_job(job)
    sel = s["selection"]
    evals = sel["evaluations"]
    assert s["compute_dtype"] == dtype
    assert [e["step"] for e in evals] == [2, 4, 6, 8]
    assert all(e["task_loss"] is not None and e["replay_loss"] is not None for e in evals)  # both splits measured
    best = min(evals, key=lambda e: (e["score"], e["step"]))
    assert sel["kept_step"] == best["step"] < 8 and f"step {best['step']} of 8" in sel["reason"]
    assert evals[-1]["score"] > best["score"]  # the planted tail: the last is worse
    out = tmp_path / "out"
    kept = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    assert kept == (out / "best_adapter" / "adapter_model.safetensors").read_bytes()
    assert kept != (out / "checkpoints" / "step-00000008" / "adapter_model.safetensors").read_bytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_patience_stops_training_early(run_job, tmp_path, demo_models, dtype):
    ds, val = _datasets(tmp_path, demo_models["student"])
    job = make_job(
        tmp_path / "out",
        demo_models["student"],
        ds,
        student=small(dtype),
        max_steps=12,
        learning_rate=5e-2,
        micro_batch_size=4,
        warmup_steps=0,
        eval_rows=8,
        selection={"rule": "best_heldout_loss", "every_steps": 2, "patience": 1},
    )
    job.validation_path = str(val)
    s = run_job(job)
    sel = s["selection"]
    evals = sel["evaluations"]
    assert s["compute_dtype"] == dtype
    assert [e["step"] for e in evals] == [2, 4] and evals[1]["score"] > evals[0]["score"], evals  # rose at once
    assert sel["stopped_early"] and sel["kept_step"] == 2 and "stopped early" in sel["reason"]
    assert s["trained_steps"] == 4  # of 12: stopped at the second evaluation
