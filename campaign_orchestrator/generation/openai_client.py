"""A client for any OpenAI-compatible endpoint (vLLM server, TGI, SGLang, hosted providers).

``/v1/completions`` (default) or ``/v1/chat/completions`` (``chat=True``), async HTTP with at
most ``max_concurrency`` requests in flight, and for every request:

- retries on 408/409/429/5xx, timeouts and dropped connections, with exponential backoff and
  full jitter capped at ``backoff_max_s`` (tenacity); when the server sends ``Retry-After``
  (seconds or an HTTP date) or ``retry-after-ms``, the client waits that long instead (plus up
  to 10% jitter), however much longer than ``backoff_max_s`` it is, up to ``max_retry_after_s``
  (default 10 minutes: a guard against absurd values);
- requests-per-minute and tokens-per-minute limits (token buckets holding one second of
  budget; a request reserves ``prompt bytes / 4 + max_tokens`` tokens and is then charged what
  the endpoint's ``usage`` says it used: the difference is refunded, or owed when the estimate
  was short);
- a clear, immediate error for what retrying cannot fix: a rejected API key (401/403, fatal:
  the run stops), an unknown model or wrong URL (404, fatal), an endpoint that cannot be
  reached after the retries (fatal), and a request the endpoint refuses (400/413/422, e.g. a
  prompt longer than the context: that one request fails, counted, the others go on).

Transport: ``aiohttp``. At high concurrency the loop is bound by the client's CPU per request, and
``aiohttp`` spends the least of it: ``httpx`` (``httpcore``'s pool, encode/httpx#3215) and ``httpx`` on
``aiohttp`` (``httpx-aiohttp``) were both slower (docs/results.md, "The OpenAI-compatible client's transport").

The API key is sent as ``Authorization: Bearer``; it is never logged, never part of an
error message (echoes of it in response bodies are redacted) and never stored in a result.

Two ways to use it::

    client = OpenAICompatibleClient("http://localhost:8000/v1", "my-model", max_concurrency=64)
    outs = client.generate(["encode abc ="], max_new_tokens=16)       # list[Completion], in order

    await client.arun(requests, sampling, on_done)   # GenRequest objects; on_done(req, completion)
                                                     # is called as each one finishes
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_base

from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.requests import GenRequest, Sampling

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})


class EndpointError(RuntimeError):
    """A problem with the endpoint that retrying cannot fix; the whole run stops."""


class AuthenticationError(EndpointError):
    pass


class EndpointUnreachable(EndpointError):
    pass


class _Retryable(Exception):
    def __init__(self, message: str, kind: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind, self.retry_after = kind, retry_after


class _Rejected(Exception):
    pass


def parse_retry_after(headers) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (delta seconds or HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if not ra:
        return None
    try:
        return max(0.0, float(ra))
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(ra)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - time.time())


def _transport_kind(e: BaseException) -> str:
    """ "connect" (nothing listening, DNS), "timeout" or "transport" (dropped mid-request)."""
    if isinstance(e, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "connect"
    if isinstance(e, asyncio.TimeoutError | TimeoutError):  # includes aiohttp's Server/SocketTimeoutError
        return "timeout"
    return "transport"


class _wait_retry_after_or_backoff(wait_base):
    """``Retry-After`` when the server sent one (plus up to 10% jitter, at most
    ``retry_after_cap``), else exponential backoff with full jitter:
    uniform(0, min(cap, initial * 2**(attempt - 1)))."""

    def __init__(self, initial: float, cap: float, retry_after_cap: float):
        self.initial, self.cap, self.retry_after_cap = initial, cap, retry_after_cap

    def delay(self, attempt_number: int, retry_after: float | None) -> float:
        """Seconds to wait after failed attempt ``attempt_number`` (1-based)."""
        if retry_after is not None:  # the server knows when it will take requests again: not backoff_max_s
            return min(self.retry_after_cap, retry_after * (1 + 0.1 * random.random()))
        return random.uniform(0, min(self.cap, self.initial * 2 ** (attempt_number - 1)))

    def __call__(self, rs: RetryCallState) -> float:
        exc = rs.outcome.exception() if rs.outcome else None
        return self.delay(rs.attempt_number, getattr(exc, "retry_after", None))


class TokenBucket:
    """Async token bucket: ``per_minute`` units per minute, holding at most one second's worth
    (or one request's worth, if a single request needs more)."""

    def __init__(self, per_minute: float):
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate)
        self.tokens = self.capacity
        self.t = time.monotonic()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.t) * self.rate)
        self.t = now

    async def acquire(self, amount: float = 1.0) -> None:
        need = min(amount, self.capacity)
        async with self._lock:  # FIFO: one waiter at a time takes the next tokens
            self._refill()
            while self.tokens < need:
                await asyncio.sleep((need - self.tokens) / self.rate)
                self._refill()
            self.tokens -= amount

    def refund(self, amount: float) -> None:
        """Give back ``amount`` reserved but unused units; a negative amount (more used than
        reserved) is owed: the next :meth:`acquire` waits it off."""
        self.tokens = min(self.capacity, self.tokens + amount)


@dataclass
class ClientStats:
    requests: int = 0  # HTTP attempts sent
    succeeded: int = 0
    retries: int = 0
    failed: int = 0  # requests that produced an error completion
    retry_reasons: Counter = field(default_factory=Counter)  # "429", "500", "timeout", "connect", ...

    def as_dict(self) -> dict:
        return {
            "http_requests": self.requests,
            "succeeded": self.succeeded,
            "retries": self.retries,
            "failed": self.failed,
            "retry_reasons": dict(self.retry_reasons),
        }


def _top_from_completions(lp: dict | None, k: int | None) -> tuple[list | None, list[str] | None]:
    """The completions API's top-k (``{token text: logprob}`` per position, most likely first) and the generated
    tokens' text, or ``(None, None)``."""
    if not lp or not k or lp.get("top_logprobs") is None:
        return None, None
    out = []
    for pos in lp["top_logprobs"]:
        items = sorted((pos or {}).items(), key=lambda kv: -kv[1])[:k]
        out.append([(None, tok, float(v)) for tok, v in items])
    tokens = lp.get("tokens")
    return out, (list(tokens) if tokens is not None and len(tokens) == len(out) else None)


def _token_text(e: dict) -> str:
    """A chat logprobs entry's token as stored (campaign_orchestrator.dataset.xtok.token_string): its ``bytes``
    when the API gives them (a token may hold part of a character), else its text."""
    from campaign_orchestrator.dataset.xtok import token_string

    return token_string(bytes(e["bytes"])) if e.get("bytes") is not None else e["token"]


def _top_from_chat(lp: dict | None, k: int | None) -> tuple[list | None, list[str] | None]:
    """The chat API's top-k per position (most likely first) and the generated tokens' text, or ``(None, None)``."""
    if not lp or not k or lp.get("content") is None:
        return None, None
    out, tokens = [], []
    for pos in lp["content"]:
        items = sorted(pos.get("top_logprobs") or [], key=lambda e: -e["logprob"])[:k]
        out.append([(None, _token_text(e), float(e["logprob"])) for e in items])
        tokens.append(_token_text(pos) if pos.get("token") is not None else None)
    return out, (tokens if all(t is not None for t in tokens) else None)


# Special and template tokens a server may add to each message of a request (BOS, role markers, separators): part of
# a request's upper bound (OpenAICompatibleClient.usage_bound). ChatML adds 5 per message; Llama 3's template ~8.
PROMPT_OVERHEAD_TOKENS = 16


class OpenAICompatibleClient:
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        api_key_env: str | None = None,
        chat: bool = False,
        max_concurrency: int = 16,
        requests_per_minute: float | None = None,
        tokens_per_minute: float | None = None,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 6,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        max_retry_after_s: float = 600.0,
        max_consecutive_failures: int | None = None,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model, self.chat = model, chat
        self._api_key = api_key or None
        self._key_source = f"environment variable {api_key_env}" if api_key_env else "the API key"
        self.max_concurrency = max_concurrency
        self.rpm, self.tpm = requests_per_minute, tokens_per_minute
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.max_retries = max_retries
        self.backoff_initial_s, self.backoff_max_s = backoff_initial_s, backoff_max_s
        self.max_retry_after_s = max_retry_after_s
        self.max_consecutive_failures = max_consecutive_failures or max(16, 2 * max_concurrency)
        self.stats = ClientStats()
        # (rpm, tpm) buckets shared with other clients (the workers of one Ray job:
        # campaign_orchestrator/generation/scaleout/
        # ratelimit.py), objects with TokenBucket's acquire/refund; None: this client's own buckets per run
        self.buckets: tuple | None = None
        # an object with sent(req, bound) and received(req, completion) (scaleout/journal.py): told of each request
        # before it is sent (with its usage's upper bound: :meth:`usage_bound`) and of each answer as soon as it is
        # received, before it is handed on; None: nothing is told
        self.journal = None
        self._consecutive_failures = 0

    def __repr__(self) -> str:  # never the key
        return f"OpenAICompatibleClient({self.base_url!r}, {self.model!r}, chat={self.chat})"

    @property
    def path(self) -> str:
        return "/chat/completions" if self.chat else "/completions"

    def _redact(self, text: str) -> str:
        if self._api_key:
            text = text.replace(self._api_key, "***")
            if len(self._api_key) > 8:  # providers echo a masked key: "sk-abc...wxyz"
                text = text.replace(self._api_key[-4:], "***")
        return text

    # ------------------------------------------------------------------ one request

    def _body(self, req: GenRequest, s: Sampling) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "n": 1,
        }
        if not s.greedy:
            body["seed"] = req.seed
        if self.chat:
            body["messages"] = (
                list(req.messages) if req.messages is not None else [{"role": "user", "content": req.prompt}]
            )
            if s.logprobs:
                body |= {"logprobs": True, "top_logprobs": s.logprobs}
        else:
            body["prompt"] = req.prompt
            if s.logprobs:
                body["logprobs"] = s.logprobs
        return body

    @staticmethod
    def usage_bound(req: GenRequest, s: Sampling) -> tuple[int, int]:
        """The most a request can be billed, ``(prompt tokens, completion tokens)``, before its answer says: the
        prompt's UTF-8 bytes (a byte-level or byte-fallback tokenizer's every token holds at least one byte) plus
        ``PROMPT_OVERHEAD_TOKENS`` per message for the special and template tokens a server adds, and
        ``max_tokens``."""
        texts = [req.prompt] if req.messages is None else [m.get("content") or "" for m in req.messages]
        return sum(len(t.encode()) + PROMPT_OVERHEAD_TOKENS for t in texts), s.max_new_tokens

    @staticmethod
    def _estimate_tokens(req: GenRequest, s: Sampling) -> int:
        text = req.prompt if req.messages is None else "".join(m.get("content", "") for m in req.messages)
        return math.ceil(len(text.encode()) / 4) + s.max_new_tokens

    def _detail(self, text: str) -> str:
        try:
            body = json.loads(text)
            msg = body.get("error", body) if isinstance(body, dict) else body
            msg = msg.get("message", msg) if isinstance(msg, dict) else msg
            text = msg if isinstance(msg, str) else json.dumps(msg)
        except (ValueError, AttributeError):
            pass
        return self._redact(text.strip()[:300])

    async def _post(self, session: aiohttp.ClientSession, body: dict) -> dict:
        self.stats.requests += 1
        try:
            async with session.post(self._url, data=json.dumps(body).encode()) as r:
                code = r.status
                if code == 200:
                    try:
                        return json.loads(await r.read())
                    except ValueError:
                        raise _Retryable(
                            f"{self.base_url}{self.path} answered 200 with a body that is not JSON", "bad_body"
                        ) from None
                text, headers = await r.text(errors="replace"), r.headers
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            kind = _transport_kind(e)
            what = {
                "connect": f"cannot connect to {self.base_url}",
                "timeout": f"no answer within the timeout ({self.timeout_s} s)",
            }.get(kind, "connection dropped")
            raise _Retryable(f"{what} ({type(e).__name__}: {self._redact(str(e))[:200]})", kind) from None
        if code in (401, 403):
            how = (
                f"check the key in {self._key_source}"
                if self._api_key
                else "no API key was sent: set teacher.api_key_env to the name of the variable holding it"
            )
            raise AuthenticationError(
                f"{self.base_url} rejected the request with HTTP {code} ({self._detail(text)}); {how}"
            )
        if code == 404:
            raise EndpointError(
                f"{self.base_url}{self.path} answered 404 ({self._detail(text)}): check base_url "
                f"(it usually ends in /v1), the served model name {self.model!r}, and `chat`"
            )
        if code in RETRY_STATUS:
            raise _Retryable(f"HTTP {code}: {self._detail(text)}", str(code), parse_retry_after(headers))
        raise _Rejected(f"HTTP {code}: {self._detail(text)}")

    def _parse(self, data: dict, s: Sampling, latency: float, retries: int) -> Completion:
        try:
            ch = data["choices"][0]
            text = ch["message"]["content"] if self.chat else ch["text"]
        except (KeyError, IndexError, TypeError):
            return Completion.failed(
                f"unexpected response shape: {self._redact(json.dumps(data)[:200])}", latency_s=latency, retries=retries
            )
        usage = data.get("usage") or {}
        top, tokens = (_top_from_chat if self.chat else _top_from_completions)(ch.get("logprobs"), s.logprobs)
        if s.logprobs and top is None and text:
            raise EndpointError(
                f"{self.base_url}{self.path} answered without log-probabilities, but teacher.sampling.logprobs asks "
                f"for the top {s.logprobs}: this endpoint does not return them (or not on "
                f"{'chat' if self.chat else 'completions'} requests); stopping before paying for the rest. Remove "
                "teacher.sampling.logprobs and use training.distillation.loss 'sequence', or use a teacher that "
                "returns top-k log-probabilities"
            )
        return Completion(
            text or "",
            ch.get("finish_reason") or "stop",
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            latency,
            top_logprobs=top,
            token_strings=tokens,
            retries=retries,
        )

    async def complete(
        self,
        session: aiohttp.ClientSession,
        req: GenRequest,
        s: Sampling,
        rpm: TokenBucket | None,
        tpm: TokenBucket | None,
    ) -> Completion:
        body = self._body(req, s)
        est = self._estimate_tokens(req, s)
        attempts = 0
        t0 = time.perf_counter()

        async def attempt_once() -> dict:
            nonlocal attempts
            attempts += 1
            if rpm is not None:
                await rpm.acquire(1)
            if tpm is not None:
                await tpm.acquire(est)
            return await self._post(session, body)

        def count_retry(rs: RetryCallState) -> None:
            exc = rs.outcome.exception() if rs.outcome else None
            self.stats.retries += 1
            self.stats.retry_reasons[getattr(exc, "kind", "other")] += 1

        try:
            try:
                data = await attempt_once()  # the common case, without building a retry loop
            except _Retryable as first:
                pending: _Retryable | None = first
                retrying = AsyncRetrying(
                    retry=retry_if_exception_type(_Retryable),
                    stop=stop_after_attempt(self.max_retries + 1),
                    wait=_wait_retry_after_or_backoff(
                        self.backoff_initial_s, self.backoff_max_s, self.max_retry_after_s
                    ),
                    before_sleep=count_retry,
                    reraise=True,
                )
                async for attempt in retrying:
                    with attempt:
                        if pending is not None:  # the first failure is tenacity's attempt 1: it waits, then retries
                            e, pending = pending, None
                            raise e from None
                        data = await attempt_once()
        except _Retryable as e:
            self.stats.failed += 1
            self._consecutive_failures += 1
            if e.kind == "connect":
                raise EndpointUnreachable(
                    f"{e} (after {attempts} attempts); is the server running and base_url right?"
                ) from None
            if self._consecutive_failures >= self.max_consecutive_failures:
                raise EndpointError(
                    f"{self._consecutive_failures} requests in a row failed after {attempts} attempts "
                    f"each (last: {e}); stopping instead of retrying forever"
                ) from None
            return Completion.failed(
                f"gave up after {attempts} attempts: {e}", latency_s=time.perf_counter() - t0, retries=attempts - 1
            )
        except _Rejected as e:
            self.stats.failed += 1
            return Completion.failed(
                f"the endpoint refused the request: {e}", latency_s=time.perf_counter() - t0, retries=attempts - 1
            )
        self._consecutive_failures = 0
        self.stats.succeeded += 1
        out = self._parse(data, s, time.perf_counter() - t0, attempts - 1)
        if tpm is not None and out.prompt_tokens is not None and out.completion_tokens is not None:
            tpm.refund(est - out.prompt_tokens - out.completion_tokens)
        return out

    # ------------------------------------------------------------------ many requests

    def _session(self) -> aiohttp.ClientSession:
        import yarl

        self._url = yarl.URL(self.base_url + self.path)  # parsed once, not per request
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        connector = aiohttp.TCPConnector(limit=self.max_concurrency, limit_per_host=self.max_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
        # no cookie jar: an API client has no use for cookies, and the jar costs CPU on every request
        return aiohttp.ClientSession(
            headers=headers,
            connector=connector,
            timeout=timeout,
            raise_for_status=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def arun(
        self, requests: Sequence[GenRequest], sampling: Sampling, on_done: Callable[[GenRequest, Completion], None]
    ) -> None:
        """Answer every request with at most ``max_concurrency`` in flight; ``on_done`` is called
        as each finishes (in completion order). An :class:`EndpointError` stops the run: requests
        in flight are cancelled, those already finished have been handed to ``on_done``."""
        rpm = TokenBucket(self.rpm) if self.rpm else None
        tpm = TokenBucket(self.tpm) if self.tpm else None
        if self.buckets is not None:
            rpm, tpm = self.buckets
        it = iter(requests)

        async with self._session() as session:
            journal = self.journal

            async def worker() -> None:
                for req in it:  # shared iterator: each request is taken by exactly one worker
                    if journal is None:
                        on_done(req, await self.complete(session, req, sampling, rpm, tpm))
                        continue
                    journal.sent(req, self.usage_bound(req, sampling))
                    c = await self.complete(session, req, sampling, rpm, tpm)
                    journal.received(req, c)  # what it was billed, before the answer goes anywhere
                    on_done(req, c)

            tasks = [asyncio.create_task(worker()) for _ in range(min(self.max_concurrency, max(1, len(requests))))]
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()

    def _run_loop(
        self,
        requests: Sequence[GenRequest],
        sampling: Sampling,
        on_done: Callable[[GenRequest, Completion], None],
        box: dict,
    ) -> None:
        try:  # uvloop (installed with uvicorn[standard]) spends ~15-20% less CPU per request here
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            factory = None

        async def main() -> None:
            box["loop"], box["task"] = asyncio.get_running_loop(), asyncio.current_task()
            await self.arun(requests, sampling, on_done)

        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())

    def run(
        self, requests: Sequence[GenRequest], sampling: Sampling, on_done: Callable[[GenRequest, Completion], None]
    ) -> None:
        """Synchronous :meth:`arun`, on its own event loop in a helper thread (``on_done`` is called
        there). The calling thread only waits, so a signal reaches it as usual (uvloop, run in the
        main thread, would take SIGINT/SIGTERM for itself and swallow what the handler raises: Ctrl-C
        would not stop a teacher stage). When the wait is interrupted, the requests in flight are
        cancelled, the loop is shut down, and the interruption is raised here."""
        box: dict = {}

        def target() -> None:
            try:
                self._run_loop(requests, sampling, on_done, box)
            except BaseException as e:  # re-raised in the caller's thread
                box["error"] = e

        th = threading.Thread(target=target, name="openai-client", daemon=True)
        th.start()
        try:
            while th.is_alive():
                th.join(0.5)
        except BaseException:
            loop, task = box.get("loop"), box.get("task")
            if loop is not None and task is not None:
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop already closed
                    pass
            th.join(10)
            raise
        if "error" in box:
            raise box["error"]

    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        logprobs: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """One completion per prompt, in input order (the same call shape as
        :meth:`campaign_orchestrator.generation.local.LocalModel.generate`)."""
        s = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, logprobs=logprobs)
        reqs = [GenRequest(str(i), p, 0, seed) for i, p in enumerate(prompts)]
        out: list[Completion | None] = [None] * len(reqs)

        def done(req: GenRequest, c: Completion) -> None:
            out[int(req.key)] = c
            if progress:
                progress(1)

        self.run(reqs, s, done)
        return out  # type: ignore[return-value]  # every slot was filled
