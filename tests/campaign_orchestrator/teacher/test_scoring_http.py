"""The HTTP teacher scorer (campaign_orchestrator.teacher.scoring_http) against a real server process started
here (`python -m campaign_orchestrator.teacher serve` on the demo teacher, an API key required): the same
numbers as the in-process LocalModel.score on the same text, chat-message prompts rendered with the
teacher's template, a pair past the context failing alone, prefill tokens counted, the key never shown; and
the OpenAI client's retries under it (a server answering 503 first)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from campaign_orchestrator.generation.openai_client import AuthenticationError
from campaign_orchestrator.teacher.scoring_http import HTTPTeacherScorer
from tests.support import REPO_ROOT
from tests.support.dataprep_support import CHAT

NAME = "demo-teacher"
KEY_ENV, KEY = "TEST_TEACHER_SERVER_KEY", "sk-scoring-http-abcdef0123456789"
LONG = "encode " + "abcdefgh" * 8 + " ="  # past the demo teacher's 64 positions


@pytest.fixture(scope="module")
def gen(demo_models):
    from campaign_orchestrator.generation.local import LocalModel

    # both sides in fp32: in bf16 (auto on an AVX512-BF16 CPU) the server's batches of 3 and these of 4 pad
    # differently, which moves a log-probability by up to 0.06
    g = LocalModel.from_path(demo_models["teacher"], batch_size=4, compute_dtype="float32")
    g.tok.chat_template = CHAT  # the demo tokenizer has none: messages need one (the server never renders)
    return g


@pytest.fixture(scope="module")
def server_proc(demo_models):
    """The teacher server as its own process, through its command line (started: it loads while the test
    process loads its own model); ``(process, port file)``."""
    d = Path(tempfile.mkdtemp(prefix="teacher-serve-"))
    port_file = d / "port"
    env = os.environ | {KEY_ENV: KEY, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "campaign_orchestrator.teacher",
            "serve",
            "--model",
            str(demo_models["teacher"]),
            "--served-name",
            NAME,
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--api-key-env",
            KEY_ENV,
            "--batch-size",
            "3",
            "--compute-dtype",
            "float32",
        ],
        cwd=REPO_ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc, port_file
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log = proc.stderr.read()
        assert KEY not in log  # the key never reaches the server's log


@pytest.fixture(scope="module")
def server_url(server_proc, gen):
    """The server's base URL once it accepts connections (``gen`` first: both models load side by side)."""
    proc, port_file = server_proc
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the teacher server did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port_file.read_text()}/v1"


def test_http_scores_equal_the_in_process_scores(server_url, gen):
    scorer = HTTPTeacherScorer(server_url, NAME, gen.tok, api_key=KEY, api_key_env=KEY_ENV, batch_size=2)
    chat = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "bc"},
        {"role": "user", "content": "cd"},
    ]
    prompts = ["encode abc =", chat, "encode hello =", "encode xy =", "encode longerword =", LONG]
    conts = [gen.tok(" bcd", add_special_tokens=False)["input_ids"], [10, 11, 12], [5, 6, 7, 8, 9], [], [4], [5, 6]]
    http = scorer.score(prompts, conts, top_k=3)
    local = gen.score(prompts, conts, top_k=3)
    for i in (0, 1, 2, 4):
        h, lo = http[i], local[i]
        assert h.error is None and h.token_ids == conts[i] and h.prompt_tokens == lo.prompt_tokens
        assert h.logprobs == pytest.approx(lo.logprobs, abs=1e-4)
        assert [[e[0] for e in pos] for pos in h.top_logprobs] == [[e[0] for e in pos] for pos in lo.top_logprobs]
        assert [e[2] for pos in h.top_logprobs for e in pos] == pytest.approx(
            [e[2] for pos in lo.top_logprobs for e in pos], abs=1e-4
        )
    assert http[3].logprobs == [] and http[3].top_logprobs == [] and http[3].error is None  # nothing to score
    assert http[5].error and "maximum context length" in http[5].error and http[5].logprobs == []  # alone
    scored = (0, 1, 2, 4)
    assert scorer.prefill_tokens == sum(local[i].prompt_tokens + len(conts[i]) for i in scored)
    assert scorer.completion_tokens == len(scored)  # max_tokens 1 per pair, as vLLM needs
    assert scorer.identity == f"openai:{server_url}|{NAME}@" and KEY not in repr(scorer)


def test_a_rejected_key_stops_scoring_without_showing_it(server_url, gen):
    scorer = HTTPTeacherScorer(server_url, NAME, gen.tok, api_key="sk-wrong-key-000000", api_key_env=KEY_ENV)
    with pytest.raises(AuthenticationError) as e:
        scorer.score(["encode ab ="], [[5]], top_k=2)
    assert "401" in str(e.value) and KEY_ENV in str(e.value) and "sk-wrong-key-000000" not in str(e.value)
    assert scorer.prefill_tokens == 0


def test_from_spec_reads_the_key_from_the_variable_the_campaign_names(server_url, gen, monkeypatch):
    from campaigns.spec import TeacherSpec

    monkeypatch.setenv(KEY_ENV, KEY)
    spec = TeacherSpec(backend="openai", model=NAME, base_url=server_url, api_key_env=KEY_ENV, price="unpriced")
    scorer = HTTPTeacherScorer.from_spec(spec, gen.tok)
    assert scorer.score(["encode ab ="], [[5, 6]], top_k=1)[0].error is None
    monkeypatch.delenv(KEY_ENV)
    from campaign_orchestrator.generation.backends import BackendError

    with pytest.raises(BackendError, match=KEY_ENV):
        HTTPTeacherScorer.from_spec(spec, gen.tok)


def test_the_clients_retries_carry_scoring_through_server_errors(gen):
    """A server that answers 503 (Retry-After 0) to every other request: every pair is still scored."""
    import uvicorn

    from campaign_orchestrator.teacher.server import TeacherServer, build_app

    inner = build_app(TeacherServer(gen, NAME))
    calls = {"n": 0}

    async def flaky(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            calls["n"] += 1
            if calls["n"] % 2:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"0")],
                    }
                )
                await send({"type": "http.response.body", "body": b'{"error": {"message": "busy"}}'})
                return
        await inner(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(flaky, log_level="warning", access_log=False))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and th.is_alive(), "the flaky server did not start"
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        scorer = HTTPTeacherScorer(url, NAME, gen.tok, batch_size=1, max_concurrency=1, backoff_initial_s=0.01)
        prompts, conts = ["encode ab =", "encode xyz ="], [[5, 6], [7]]
        got = scorer.score(prompts, conts, top_k=2)
        want = gen.score(prompts, conts, top_k=2)
        assert [g.logprobs for g in got] == [pytest.approx(w.logprobs, abs=1e-4) for w in want]
        assert calls["n"] == 4 and scorer.requests == 2  # each request answered on its second attempt
    finally:
        server.should_exit = True
        th.join(10)
        sock.close()
