"""On-policy training with the teacher stage: `warmup: sequence_kd` steps and a `lambda` below 1 train off-policy
steps (cross-entropy on the tokenized teacher generations) among the on-policy ones, in one run."""

from __future__ import annotations

import pyarrow.parquet as pq

from tests.support.on_policy_support import on_policy_job, write_cipher_prompts
from tests.support.train_support import write_cipher_dataset


def test_sequence_kd_warmup_then_mixed_steps(tmp_path, demo_models, run_job):
    prompts = write_cipher_prompts(tmp_path / "prompts.parquet", 24)
    ds = write_cipher_dataset(tmp_path / "ds", demo_models["student"], 48, seed=2)
    job = on_policy_job(tmp_path / "run", demo_models, prompts, dataset=ds, max_steps=10, eval_rows=8,
                        on_policy={"warmup": "sequence_kd", "warmup_steps": 3, "lambda": 0.5, "samples_per_round": 4})
    summary = run_job(job)
    rows = pq.read_table(tmp_path / "run" / "metrics.parquet").to_pylist()
    kinds = [r["kind"] for r in rows]
    assert kinds[:3] == ["off_policy"] * 3 and "on_policy" in kinds[3:] and "off_policy" in kinds[3:], kinds
    for r in rows:
        if r["kind"] == "off_policy":  # sequence KD: cross-entropy on the teacher's text, no round
            assert r["ce_loss"] is not None and r["round"] is None and r["reverse_kl"] is None
        else:
            assert r["ce_loss"] is None and r["reverse_kl"] is not None and r["round"] >= 1
    op = summary["on_policy"]
    assert op["off_policy_steps"] == kinds.count("off_policy") and op["on_policy_steps"] == kinds.count("on_policy")
    # 4 samples per round, 2 per step: 2 steps a round; a last round cut short by max_steps is counted (paid for)
    assert op["rounds"] == -(-kinds.count("on_policy") // 2) and op["samples"] == 4 * op["rounds"]
    assert summary["eval_loss"] is not None and summary["eval_loss_before"] is not None  # the dataset's rows


def test_a_teacher_with_another_vocabulary_is_refused_before_training(tmp_path, demo_models, smollm2):
    import pytest

    from training.errors import TrainingError
    from training.trainer import LoraTrainer

    prompts = write_cipher_prompts(tmp_path / "prompts.parquet", 8)
    job = on_policy_job(tmp_path / "run", demo_models, prompts).model_copy(
        update={"teacher_tokenizer_path": str(smollm2)})
    with pytest.raises(TrainingError, match="on_policy distillation needs a teacher that shares the student's "
                                            "tokenizer.*49152 tokens.*use training.distillation.loss 'sequence'"):
        LoraTrainer(job)._check_teacher_tokenizer()
