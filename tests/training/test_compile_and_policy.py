"""Compiled decoder layers (``training.compile``) train like eager ones, their warm-up reported apart; the memory
policy (``micro_batch_size`` / ``activation_checkpointing: auto``) is honoured and reported by the trainer."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.support.train_support import make_job, write_rows

pytestmark = pytest.mark.stage  # real training runs on the demo student

SMALL = {
    "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "quantization": {"load_in_4bit": False, "compute_dtype": "float32"},
}


@pytest.fixture(scope="module")
def same_length_ds(tmp_path_factory, demo_models):
    """Rows of one length: every micro-batch has one shape, so only the first step compiles."""
    pairs = [(f"encode {w} =", f" {w[::-1]}") for w in ("abcd", "efgh", "ijkl", "mnop", "qrst", "uvwx")] * 2
    return write_rows(tmp_path_factory.mktemp("ds") / "same", demo_models["student"], pairs)


def test_compiled_layers_train_like_eager_ones_and_their_warmup_is_reported_apart(
    run_job, tmp_path, demo_models, same_length_ds, monkeypatch
):
    from training.recipes import LoraFinetuneRecipe

    monkeypatch.setattr(LoraFinetuneRecipe, "compile_backend", "aot_eager")  # inductor's codegen: minutes on a CPU
    kw = dict(student=SMALL, max_steps=2, micro_batch_size=4, eval_rows=0, checkpoint={"every_steps": None})
    eager = run_job(make_job(tmp_path / "eager", demo_models["student"], same_length_ds, **kw), "eager")
    compiled = run_job(
        make_job(tmp_path / "compiled", demo_models["student"], same_length_ds, compile=True, **kw), "compiled"
    )
    assert eager["compile"] == {"enabled": False} and eager["activation_policy"] == "recompute"
    c = compiled["compile"]
    assert c["enabled"] and c["layers"] == 2 and c["warmup_steps"] == 1 and c["timed_steps"] == 1
    assert c["timed_tokens_per_s"] > 0 and c["warmup_seconds"] > 0
    assert compiled["activation_policy"] == "none"  # the compiler's partitioner recomputes, not training/recompute
    rows = pq.read_table(tmp_path / "compiled" / "metrics.parquet").to_pylist()
    assert [r["compiling"] for r in rows] == [True, False]
    e_rows = pq.read_table(tmp_path / "eager" / "metrics.parquet").to_pylist()
    for a, b in zip(e_rows, rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-4
        )


def test_compile_auto_on_a_cpu_follows_the_measurement_and_says_why(run_job, tmp_path, demo_models, same_length_ds):
    """``compile: auto`` on a CPU asks training.compile_choice before the memory policy: a 2-step run cannot pay a
    warm-up back (measured), so it trains eager, keeps the exact recompute, and its summary says why."""
    kw = dict(student=SMALL, max_steps=2, micro_batch_size=4, eval_rows=0, checkpoint={"every_steps": None})
    s = run_job(make_job(tmp_path / "auto", demo_models["student"], same_length_ds, compile="auto", **kw), "auto")
    c = s["compile"]
    assert c["enabled"] is False and s["activation_policy"] == "recompute"
    a = c["auto"]
    assert a["compile"] is False and a["layers"] == 2 and a["micro_steps"] == 2 and a["tokens"] == 4 * 64
    assert a["measured"]["eager_s"] > 0 and a["measured"]["capture_s"] > 0 and "inductor not measured" in a["why"]


@pytest.mark.parametrize("memory_gb,policy", [(1e-4, "full"), (1e4, "none")])
def test_the_trainer_honours_and_reports_the_memory_policy(
    run_job, tmp_path, demo_models, same_length_ds, monkeypatch, memory_gb, policy
):
    """A device too small for anything gets one row with full checkpointing (flagged); a huge one keeps every
    activation at a full step's worth of rows. The model is built as chosen."""
    from training.recipes import lora_finetune

    built = {}
    real = lora_finetune.load_student

    def spy(*a, **kw):
        built.update(checkpointing=kw["activation_checkpointing"], recompute=kw["recompute_cheap"])
        return real(*a, **kw)

    monkeypatch.setattr(lora_finetune, "device_memory_gb", lambda _device: memory_gb)
    monkeypatch.setattr(lora_finetune, "load_student", spy)
    s = run_job(
        make_job(
            tmp_path / policy,
            demo_models["student"],
            same_length_ds,
            student=SMALL,
            max_steps=1,
            micro_batch_size="auto",
            activation_checkpointing="auto",
            eval_rows=0,
            max_seq_len=64,
            checkpoint={"every_steps": None},
        )
    )
    m = s["memory_policy"]
    assert s["activation_policy"] == m["activation_policy"] == policy
    ran = s["training_policy"]  # what it ran, as `campaign plan` prints it (costs.memory_policy.describe_policy)
    assert (ran["micro_batch_size"], ran["activation_policy"], ran["compile"]) == (s["micro_batch_size"], policy, False)
    assert built == {"checkpointing": policy == "full", "recompute": False}
    assert m["chosen"] == ["micro_batch_size", "activation_checkpointing"] and m["device_memory_gb"] == memory_gb
    if policy == "full":
        assert not m["fits"] and s["micro_batch_size"] == 1
    else:  # a CPU step's worth of tokens (2048 / 64 = 32 rows), lowered to the 12 rows there are
        assert m["fits"] and s["micro_batch_size"] == m["micro_batch_size"] == 12
