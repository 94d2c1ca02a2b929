"""On-policy training with the teacher stage: `warmup: sequence_kd` steps and a `lambda` below 1 train off-policy
steps (cross-entropy on the tokenized teacher generations) among the on-policy ones, in one run."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.support.on_policy_support import on_policy_job, write_cipher_prompts
from tests.support.train_support import write_cipher_dataset


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread, as the launcher gives each trainer process: on a busy 2-core host more threads only spin."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sequence_kd_warmup_then_mixed_steps(tmp_path, demo_models, run_job):
    prompts = write_cipher_prompts(tmp_path / "prompts.parquet", 24)
    ds = write_cipher_dataset(tmp_path / "ds", demo_models["student"], 48, seed=2)
    job = on_policy_job(
        tmp_path / "run",
        demo_models,
        prompts,
        dataset=ds,
        max_steps=10,
        eval_rows=8,
        on_policy={"warmup": "sequence_kd", "warmup_steps": 3, "lambda": 0.5, "samples_per_round": 4},
    )
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
    from training.recipes import recipe_for

    prompts = write_cipher_prompts(tmp_path / "prompts.parquet", 8)
    job = on_policy_job(tmp_path / "run", demo_models, prompts).model_copy(
        update={"teacher_tokenizer_path": str(smollm2)}
    )
    with pytest.raises(
        TrainingError,
        match="on_policy distillation needs a teacher that shares the student's "
        "tokenizer.*49152 tokens.*use training.distillation.loss 'sequence'",
    ):
        recipe_for(job)(job)._check_teacher_tokenizer()


def test_sigterm_while_a_round_samples_stops_and_the_relaunch_samples_it_again(
    tmp_path, demo_models, run_job, monkeypatch
):
    """A stop (SIGTERM: preemption) that arrives while a round samples ends the run at once with a checkpoint of
    the state before the round; no round file is written, and the relaunch samples the round again with the same
    weights and seed: it ends where an uninterrupted run ends."""
    import os
    import signal

    import pytest
    import torch
    from safetensors.torch import load_file

    from training import on_policy as opol
    from training.errors import TrainingError

    prompts = write_cipher_prompts(tmp_path / "prompts.parquet", 16)
    jobs = {n: on_policy_job(tmp_path / n, demo_models, prompts, max_steps=4) for n in ("whole", "stopped")}
    run_job(jobs["whole"], "whole")
    sample = opol.sample

    def preempted_while_sampling(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler notes it; the first decoding step answers
        return sample(*args, **kwargs)

    monkeypatch.setattr(opol, "sample", preempted_while_sampling)
    with pytest.raises(TrainingError, match="stopped by SIGTERM while round 1 sampled, before step 1"):
        run_job(jobs["stopped"], "stopped")
    out = tmp_path / "stopped"
    assert not list((out / "rounds").glob("*.pt")) and (out / "checkpoints" / "step-00000000" / "_SUCCESS").exists()
    monkeypatch.setattr(opol, "sample", sample)
    summary = run_job(jobs["stopped"], "relaunch")
    assert summary["resumed_from_step"] == 0 and summary["on_policy"]["rounds"] == 1
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (tmp_path / "whole", out))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
