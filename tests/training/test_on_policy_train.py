"""On-policy training on the demo models: a run killed mid-round resumes on the same samples and ends where an
uninterrupted run ends; two ranks under FSDP2 sample, score and train to the loss and gradients of one process
on the same samples."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.support.on_policy_support import on_policy_job, write_cipher_prompts
from tests.support.train_support import PYTHON, REPO_ROOT, child_env

pytestmark = pytest.mark.slow

SCRIPTS = REPO_ROOT / "tests" / "support" / "train_scripts"


def _train(args: list[str], log: Path, timeout: int = 300) -> int:
    with log.open("w") as f:
        return subprocess.run(
            [PYTHON, *args], cwd=REPO_ROOT, env=child_env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout
        ).returncode


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def test_kill_mid_round_and_resume_ends_as_uninterrupted(tmp_path, demo_models, run_job, capfd):
    """12 steps in rounds of 4 (8 samples, micro 2); a checkpoint every step. A trainer process is SIGKILLed right
    after checkpoint 6 (round 2 of 3, half trained); the relaunch resumes at step 6, reads round 2's samples back
    (it does not sample again with other weights), samples round 3, and its adapter, per-step losses and round
    figures equal those of a run never killed. (The uninterrupted run and the relaunch run in this process, on
    one thread like the killed process.)"""
    prompts = write_cipher_prompts(tmp_path / "prompts.parquet", 40)
    every_step = {"every_steps": 1, "every_minutes": None, "keep_last": 2}
    jobs = {
        name: on_policy_job(tmp_path / name, demo_models, prompts, max_steps=12, checkpoint=every_step)
        for name in ("whole", "killed")
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_job(jobs["whole"], "whole")
        Path(jobs["killed"].output_dir).mkdir(parents=True)
        job_file = jobs["killed"].write(tmp_path / "killed.json")
        code = _train([str(SCRIPTS / "kill_after_checkpoint.py"), str(job_file), "6"], tmp_path / "killed-1.log")
        assert code == -9, (tmp_path / "killed-1.log").read_text()[-3000:]
        killed = Path(jobs["killed"].output_dir)
        assert not (killed / "summary.json").exists()
        assert sorted(p.name for p in (killed / "rounds").iterdir()) == [
            "round-00000-rank000.pt",
            "round-00001-rank000.pt",
        ]
        capfd.readouterr()
        run_job(jobs["killed"], "relaunch")
    finally:
        torch.set_num_threads(threads)
    second = capfd.readouterr().err
    assert "resumed from checkpoint" in second and "round 2: samples read back" in second, second[-3000:]
    assert "round 3: 8 samples" in second and "round 1:" not in second

    assert [p.name for p in (killed / "rounds").iterdir()] == ["round-00002-rank000.pt"]  # finished rounds pruned
    whole = Path(jobs["whole"].output_dir)
    a, b = _adapter(whole), _adapter(killed)
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-7, msg=k)
    sw, sk = (json.loads((d / "summary.json").read_text()) for d in (whole, killed))
    assert sk["resumed_from_step"] == 6
    losses_w = [(m["step"], m["loss"], m["round"]) for m in pq.read_table(whole / "metrics.parquet").to_pylist()]
    losses_k = [(m["step"], m["loss"], m["round"]) for m in pq.read_table(killed / "metrics.parquet").to_pylist()]
    assert [s for s, _, _ in losses_k] == list(range(1, 13))
    assert [r for _, _, r in losses_k] == [1] * 4 + [2] * 4 + [3] * 4
    for (s, lw, _), (_, lk, _) in zip(losses_w, losses_k, strict=False):
        assert lk == pytest.approx(lw, rel=1e-6, abs=1e-7), s
    op_w, op_k = sw["on_policy"], sk["on_policy"]
    assert op_k["rounds"] == op_w["rounds"] == 3 and op_k["samples"] == 24
    for rw, rk in zip(op_w["per_round"], op_k["per_round"], strict=False):
        assert {k: rk[k] for k in ("samples", "sampled_tokens", "teacher_prefill_tokens", "kl_tokens")} == {
            k: rw[k] for k in ("samples", "sampled_tokens", "teacher_prefill_tokens", "kl_tokens")
        }
        assert rk["mean_reverse_kl"] == pytest.approx(rw["mean_reverse_kl"], rel=1e-6)
    assert op_w["teacher_prefill_tokens"] > op_w["sampled_tokens"] > 0


def test_two_ranks_sample_score_and_train_like_one_process(tmp_path, demo_models):
    """World 2 (FSDP2, gloo): each rank samples its share of the round at temperature 1 (different lengths, so a
    rank whose rows are done keeps stepping until the other's are); the step's loss and gradients equal one
    process's on the same samples."""
    prompts = write_cipher_prompts(tmp_path / "prompts.parquet", 40, seed=7)  # rank 1 gets shorter words
    job = on_policy_job(
        tmp_path / "run",
        demo_models,
        prompts,
        max_steps=4,
        processes_per_node=2,
        sharding="full",
        micro_batch_size=2,
        gradient_accumulation_steps=1,
        on_policy={"samples_per_round": 8, "beta": 0.5, "max_new_tokens": 12},
    )
    Path(job.output_dir).mkdir(parents=True)
    jf = job.write(tmp_path / "job.json")
    out = tmp_path / "grads.pt"
    cmd = [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "on_policy_grad_check.py"),
        str(out),
        str(jf),
    ]
    assert _train(cmd, tmp_path / "run.log", timeout=400) == 0, (tmp_path / "run.log").read_text()[-5000:]
    r = torch.load(out, weights_only=False)
    assert r["world"] == 2
    ranks = r["per_rank"]
    assert [x["round_samples"] for x in ranks] == [4, 4]
    lengths = [x["lengths"] for x in ranks]
    assert max(max(x) for x in lengths) == r["decode_steps"]  # both ranks stepped until the longest sample
    assert max(lengths[0]) != max(lengths[1]), f"ranks should finish at different steps: {lengths}"
    assert {tuple(s["prompt_ids"]) for s in ranks[0]["samples"]}.isdisjoint(
        tuple(s["prompt_ids"]) for s in ranks[1]["samples"]
    )
    assert r["kl_tokens"] == r["reference_tokens"] > 0
    assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-5)
    g, ref = r["grads"], r["reference_grads"]
    assert set(g) == set(ref) and g
    den = sum(float(ref[k].norm() ** 2) for k in g) ** 0.5
    assert den > 0
    for k in g:
        torch.testing.assert_close(g[k], ref[k], rtol=1e-4, atol=1e-7, msg=k)


def test_a_teacher_server_is_a_drop_in_for_the_in_process_teacher(tmp_path, demo_models, run_job):
    """The same run with the teacher behind the project's own server (`python -m campaign_orchestrator.teacher
    serve`, a real process: the `openai` backend and prompt_logprobs) and with the teacher in process: the same
    samples, teacher tokens, reverse KL and adapter."""
    import sys
    import time

    prompts = write_cipher_prompts(tmp_path / "prompts.parquet", 24, seed=3)
    port_file = tmp_path / "port"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "campaign_orchestrator.teacher",
            "serve",
            "--model",
            str(demo_models["teacher"]),
            "--served-name",
            "demo-teacher",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--compute-dtype",
            "float32",
        ],
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = run_job(on_policy_job(tmp_path / "local", demo_models, prompts, max_steps=8), "local")
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()[-2000:]
            time.sleep(0.05)
        job = on_policy_job(tmp_path / "http", demo_models, prompts, max_steps=8)
        teacher = {
            "backend": "openai",
            "model": "demo-teacher",
            "price": "unpriced",
            "base_url": f"http://127.0.0.1:{port_file.read_text()}/v1",
        }
        job = job.model_copy(
            update={
                "on_policy": job.on_policy.model_copy(
                    update={"teacher_backend": "openai", "teacher": teacher, "teacher_model_path": None}
                )
            }
        )
        http = run_job(job, "http")
    finally:
        torch.set_num_threads(threads)
        server.terminate()
        server.wait(30)
    a, b = local["on_policy"], http["on_policy"]
    assert (b["teacher_backend"], a["teacher_backend"]) == ("openai", "transformers")
    assert a["rounds"] == b["rounds"] == 2
    for k in ("samples", "sampled_tokens", "teacher_prefill_tokens"):
        assert a[k] == b[k], k
    assert b["mean_reverse_kl"] == pytest.approx(a["mean_reverse_kl"], rel=1e-5)
    wa, wb = _adapter(tmp_path / "local"), _adapter(tmp_path / "http")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-6, msg=k)
