"""training.selection in the real trainer (demo student, one process): a planted over-trained tail (the held-out
rows contradict what the training rows teach, so held-out loss rises as training goes on) makes the stage return
the best evaluated checkpoint, not the last, with the step and the reason in its summary; patience stops early."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.train_support import make_job, write_rows

pytestmark = pytest.mark.stage

SMALL = {"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}


def _datasets(tmp_path, tok_dir):
    from campaign_orchestrator.demo import cipher

    rng = random.Random(3)
    gen = cipher.pairs(rng, cipher.CIPHER)
    train = [next(gen) for _ in range(24)]
    ds = write_rows(tmp_path / "train", tok_dir, train)
    # held out: the same prompts with each other's answers: the answer format is learned first (held-out loss
    # falls), then each prompt's own answer (it rises: the over-trained tail); half of them labelled replay rows
    held = [(train[i][0], train[(i + 1) % 8][1]) for i in range(8)]
    val = write_rows(tmp_path / "validation", tok_dir, held)
    f = next(val.glob("*.parquet"))
    t = pq.read_table(f)
    ids = [[f"replay:r{i}"] if i % 2 else [f"r{i}"] for i in range(len(held))]
    t = t.set_column(t.schema.get_field_index("example_ids"), "example_ids", pa.array(ids, pa.list_(pa.string())))
    pq.write_table(t.replace_schema_metadata(pq.read_schema(f).metadata), f)
    return ds, val


def test_the_kept_checkpoint_is_the_best_not_the_last(run_job, tmp_path, demo_models):
    ds, val = _datasets(tmp_path, demo_models["student"])
    job = make_job(
        tmp_path / "out",
        demo_models["student"],
        ds,
        student=SMALL,
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
    assert [e["step"] for e in evals] == [2, 4, 6, 8]
    assert all(e["task_loss"] is not None and e["replay_loss"] is not None for e in evals)  # both splits measured
    best = min(evals, key=lambda e: (e["score"], e["step"]))
    assert sel["kept_step"] == best["step"] < 8 and f"step {best['step']} of 8" in sel["reason"]
    assert evals[-1]["score"] > best["score"]  # the planted tail: the last is worse
    out = tmp_path / "out"
    kept = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    assert kept == (out / "best_adapter" / "adapter_model.safetensors").read_bytes()
    assert kept != (out / "checkpoints" / "step-00000008" / "adapter_model.safetensors").read_bytes()


def test_patience_stops_training_early(run_job, tmp_path, demo_models):
    ds, val = _datasets(tmp_path, demo_models["student"])
    job = make_job(
        tmp_path / "out",
        demo_models["student"],
        ds,
        student=SMALL,
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
    assert sel["stopped_early"] and len(sel["evaluations"]) < 6 and "stopped early" in sel["reason"]
