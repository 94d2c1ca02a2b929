"""The OpenAI-compatible teacher client against a real local HTTP server (tests.support.testserver)."""

from __future__ import annotations

import email.utils
import logging
import time

import pytest

from campaign_orchestrator.demo import cipher
from campaign_orchestrator.generation.backends import OpenAIBackend
from campaign_orchestrator.generation.blobstore import LocalStore
from campaign_orchestrator.generation.cache import GenerationCache
from campaign_orchestrator.generation.openai_client import (
    AuthenticationError,
    EndpointError,
    EndpointUnreachable,
    OpenAICompatibleClient,
    TokenBucket,
    _wait_retry_after_or_backoff,
    parse_retry_after,
)
from campaign_orchestrator.generation.requests import Sampling, namespace
from campaign_orchestrator.generation.runner import run_generation
from tests.support.testserver import ServerConfig, ServerThread, rule_answer

WORDS = [cipher.random_word(__import__("random").Random(i)) + "x" * (i % 3) for i in range(200)]
PROMPTS = [{"id": f"p{i}", "prompt": cipher.prompt_for(w)} for i, w in enumerate(WORDS)]


def _cache(tmp_path, backend, sampling) -> GenerationCache:
    return GenerationCache(LocalStore(tmp_path / "cache"), namespace(backend.identity, sampling), tmp_path / "spool")


def test_completions_concurrent_in_order_with_usage_and_logprobs():
    with ServerThread(ServerConfig(latency_s=0.05)) as srv:
        client = OpenAICompatibleClient(srv.base_url, "teacher", max_concurrency=32)
        prompts = [p["prompt"] for p in PROMPTS[:96]]
        outs = client.generate(prompts, max_new_tokens=16, logprobs=3)
        assert srv.stats.max_in_flight > 8  # really concurrent (speed itself is measured in benchmarks/)
    assert [o.text for o in outs] == [rule_answer(p) for p in prompts]
    o = outs[0]
    assert o.finish_reason == "stop" and o.prompt_tokens == 3 and o.completion_tokens == len(o.text) + 1
    assert len(o.top_logprobs) == o.completion_tokens and all(len(pos) == 3 for pos in o.top_logprobs)
    assert [pos[0][1] for pos in o.top_logprobs[:-1]] == list(o.text)  # most likely first, token strings
    assert all(pos[0][0] is None and pos[0][2] >= pos[1][2] for pos in o.top_logprobs)


def test_chat_endpoint_and_truncation():
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        client = OpenAICompatibleClient(srv.base_url, "teacher", chat=True)
        outs = client.generate(["encode hello =", "encode abcdefgh ="], max_new_tokens=4, logprobs=2)
        assert srv.stats.by_status[200] == 2
    assert outs[0].text == rule_answer("encode hello =")[:4] and outs[0].finish_reason == "length"
    assert len(outs[0].top_logprobs) == 4 and len(outs[0].top_logprobs[0]) == 2


def test_faults_are_retried_until_every_prompt_completes_once(tmp_path):
    cfg = ServerConfig(latency_s=0.01, fail_429=0.1, fail_500=0.1, timeout_rate=0.05, hang_s=3.0, retry_after_s=0.05)
    with ServerThread(cfg) as srv:
        client = OpenAICompatibleClient(
            srv.base_url,
            "teacher",
            max_concurrency=32,
            timeout_s=0.5,
            backoff_initial_s=0.02,
            backoff_max_s=0.5,
            max_retries=10,
        )
        backend = OpenAIBackend(client)
        s = Sampling(max_new_tokens=16)
        res = run_generation(PROMPTS, backend, s, _cache(tmp_path, backend, s))
        ok_by_prompt = dict(srv.stats.ok_by_prompt)
    st = res.stats
    assert st.failed == 0 and st.generated == len(PROMPTS)
    assert sorted(ok_by_prompt) == sorted(p["prompt"] for p in PROMPTS)
    assert set(ok_by_prompt.values()) == {1}  # none answered twice
    assert st.retries > 0 and st.retries == sum(r["retries"] for r in res.rows)
    assert {"429", "500", "timeout"} <= set(st.retry_reasons)
    assert [r["completion"] for r in res.rows] == [rule_answer(p["prompt"]) for p in PROMPTS]


def test_retry_after_header_is_honored():
    from multidict import CIMultiDict

    assert parse_retry_after(CIMultiDict({"Retry-After": "2"})) == 2.0
    assert parse_retry_after(CIMultiDict({"retry-after-ms": "250"})) == 0.25
    assert parse_retry_after(CIMultiDict({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0.0
    in_a_minute = email.utils.formatdate(time.time() + 60, usegmt=True)
    assert 58 <= parse_retry_after(CIMultiDict({"Retry-After": in_a_minute})) <= 60
    assert parse_retry_after(CIMultiDict()) is None
    # backoff_max_s caps the client's own backoff, not the wait the server asks for
    with ServerThread(ServerConfig(latency_s=0.0, fail_429=1.0, retry_after_s=0.3)) as srv:
        client = OpenAICompatibleClient(
            srv.base_url, "teacher", max_retries=2, backoff_initial_s=0.05, backoff_max_s=0.05
        )
        t0 = time.perf_counter()
        out = client.generate(["encode abc ="], 8)[0]
        wall = time.perf_counter() - t0
    assert out.error and "429" in out.error and out.retries == 2
    assert wall >= 0.6  # two waits of Retry-After (0.3 s), although the backoff is capped at 0.05 s


def test_retry_after_longer_than_backoff_max_is_waited_in_full():
    wait = _wait_retry_after_or_backoff(0.5, 30.0, 600.0)  # the client's defaults
    for attempt in (1, 3, 6):
        assert all(60 <= wait.delay(attempt, 60.0) <= 66 for _ in range(50))  # Retry-After: 60, +<=10% jitter
        assert all(0 <= wait.delay(attempt, None) <= min(30.0, 0.5 * 2 ** (attempt - 1)) for _ in range(50))
    assert all(0 <= wait.delay(20, None) <= 30 for _ in range(50))  # the backoff alone stays under backoff_max_s
    assert wait.delay(1, 86400.0) == 600.0  # an absurd Retry-After is cut at max_retry_after_s
    assert wait.delay(1, 0.0) == 0.0
    client = OpenAICompatibleClient("http://127.0.0.1:1/v1", "teacher")
    assert client.backoff_max_s == 30.0 and client.max_retry_after_s == 600.0


def test_rejected_api_key_is_a_clear_fatal_error_without_the_key(tmp_path, caplog):
    secret = "sk-test-0123456789abcdef"
    with ServerThread(ServerConfig(latency_s=0.0, api_key="the-right-key")) as srv:
        client = OpenAICompatibleClient(srv.base_url, "teacher", api_key=secret, api_key_env="TEACHER_KEY")
        backend = OpenAIBackend(client)
        s = Sampling(max_new_tokens=8)
        caplog.set_level(logging.DEBUG)
        with pytest.raises(AuthenticationError) as e:
            run_generation(PROMPTS[:40], backend, s, _cache(tmp_path, backend, s))
        assert 1 <= srv.stats.received <= client.max_concurrency  # never retried: the run stops at once
    msg = str(e.value)
    assert "401" in msg and "TEACHER_KEY" in msg and secret not in msg and secret[-4:] not in msg
    assert secret not in caplog.text and secret not in repr(client)


def test_unreachable_endpoint_fails_fast_and_keeps_finished_generations(tmp_path):
    # Finish some generations first, then point the same teacher identity at a dead port.
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        client = OpenAICompatibleClient(srv.base_url, "teacher")
        backend = OpenAIBackend(client, identity="openai:test-teacher")
        s = Sampling(max_new_tokens=16)
        run_generation(PROMPTS[:10], backend, s, _cache(tmp_path, backend, s))
    dead = OpenAICompatibleClient(srv.base_url, "teacher", max_retries=2, backoff_initial_s=0.01, connect_timeout_s=1)
    backend = OpenAIBackend(dead, identity="openai:test-teacher")
    t0 = time.perf_counter()
    with pytest.raises(EndpointUnreachable, match="cannot connect"):
        run_generation(PROMPTS[:30], backend, s, _cache(tmp_path, backend, s))
    assert time.perf_counter() - t0 < 30  # an error, not a hang
    assert len(_cache(tmp_path, backend, s)) == 10  # what finished before is still there


def test_prompt_longer_than_context_is_a_counted_skip(tmp_path):
    long_prompt = {"id": "long", "prompt": "encode " + "word " * 100 + "="}
    with ServerThread(ServerConfig(latency_s=0.0, context_length=64)) as srv:
        client = OpenAICompatibleClient(srv.base_url, "teacher")
        backend = OpenAIBackend(client)
        s = Sampling(max_new_tokens=16)
        res = run_generation(PROMPTS[:5] + [long_prompt], backend, s, _cache(tmp_path, backend, s))
        assert srv.stats.by_status[400] == 1  # refused once, not retried
    bad = res.rows[-1]
    assert bad["finish_reason"] == "error" and "context length" in bad["error"]
    assert res.stats.failed == 1 and res.stats.generated == 5
    assert len(_cache(tmp_path, backend, s)) == 5  # errors are not cached: asked again next run


def test_wrong_model_name_is_a_clear_error():
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        client = OpenAICompatibleClient(srv.base_url, "no-such-model")
        with pytest.raises(EndpointError, match="404.*no-such-model"):
            client.generate(["encode abc ="], 8)


def test_requests_per_minute_limit_spaces_requests():
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        client = OpenAICompatibleClient(srv.base_url, "teacher", max_concurrency=16, requests_per_minute=1200)
        t0 = time.perf_counter()
        client.generate([p["prompt"] for p in PROMPTS[:40]], 8)
        wall = time.perf_counter() - t0
    # 20 requests/s with one second of burst: 40 requests need at least ~1 s
    assert wall >= 0.9


def _record_client_sleeps(monkeypatch) -> list[float]:
    """The seconds the OpenAI client's code asks ``asyncio.sleep`` for (its rate limiters and backoff), recorded and
    still slept: what the limiter decided, which a loaded host cannot lengthen (it only ever oversleeps them)."""
    import asyncio

    from campaign_orchestrator.generation import openai_client

    asked: list[float] = []

    async def sleep(delay, *a, **kw):
        asked.append(float(delay))
        return await asyncio.sleep(delay, *a, **kw)

    class Recording:  # the module's `asyncio`: the real one, with a recorded sleep
        def __getattr__(self, name):
            return getattr(asyncio, name)

    Recording.sleep = staticmethod(sleep)
    monkeypatch.setattr(openai_client, "asyncio", Recording())
    return asked


def test_tokens_per_minute_limit_holds_the_token_rate(monkeypatch):
    tpm = 12_000  # 200 tokens/s, one second (200 tokens) of burst
    asked = _record_client_sleeps(monkeypatch)
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        client = OpenAICompatibleClient(srv.base_url, "teacher", max_concurrency=16, tokens_per_minute=tpm)
        t0 = time.perf_counter()
        outs = client.generate([p["prompt"] for p in PROMPTS[:60]], 8)
        wall = time.perf_counter() - t0
        assert srv.stats.ok == 60
    used = sum(o.prompt_tokens + o.completion_tokens for o in outs)  # what the endpoint counted (usage)
    rate, burst = tpm / 60, tpm / 60
    assert used > 3 * burst  # enough tokens that the limit, not the burst, decides the time
    sustained = (used - burst) / wall
    assert sustained <= rate * 1.05  # the limit holds (a loaded host only lowers the rate)
    # and the limiter does not hold back much more than it must: the waits it asked for, not the wall time (which
    # a loaded host stretches), stay within 2.5x of what the tokens beyond the burst need
    assert 0 < sum(asked) <= 2.5 * (used - burst) / rate, (sum(asked), used, burst)
    # no request limit set: requests go as fast as the token budget allows
    assert client.stats.requests == 60 and client.stats.retries == 0


def test_token_bucket_charges_tokens_used_beyond_the_estimate(monkeypatch):
    import asyncio

    asked = _record_client_sleeps(monkeypatch)

    async def go() -> float:
        bucket = TokenBucket(6000)  # 100/s, capacity 100
        await bucket.acquire(50)
        bucket.refund(-150)  # the request used 200, 150 more than reserved: owed
        t0 = time.monotonic()
        await bucket.acquire(10)  # waits the debt off: from -100 to 10 at 100/s
        return time.monotonic() - t0

    assert asyncio.run(go()) >= 1.0  # it waited (a loaded host only waits longer)
    assert 1.0 <= sum(asked) <= 1.1 + 1e-6  # what it asked for: the debt and the 10 new, at 100/s, no more
