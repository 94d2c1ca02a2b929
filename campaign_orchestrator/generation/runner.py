"""The generation loop: prompts in, one row per (prompt, sample) out, nothing paid for twice.

1. Build the requests (``n`` per prompt) and their content-addressed keys.
2. Seal spools left by a killed run, then look every key up in the cache.
3. Send only the missing, distinct requests to the backend; each finished generation goes to
   the cache writer at once (see :mod:`campaign_orchestrator.generation.cache`), failures are counted and not cached.
4. Assemble the rows in prompt order from cache hits and new results.

Money: a cache hit costs nothing. ``progress`` sees every row (hits too: it is a display); the
``budget`` (a :class:`campaign_orchestrator.costs.budget.BudgetGuard`) sees only the requests this
run pays for: first the planner's estimate for the share of requests the cache lacks
(``check_planned``), then each new generation's usage as it finishes (``charge``: the tokens the
response reports, and the seconds spent generating since the first paid request started).

If the backend stops with an error (a rejected key, an unreachable endpoint, Ctrl-C), what
finished is sealed into the cache before the error propagates: the next run continues there.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from campaign_orchestrator.generation.backends import Backend
from campaign_orchestrator.generation.cache import GenerationCache
from campaign_orchestrator.generation.completion import Completion
from campaign_orchestrator.generation.requests import GenRequest, Sampling, build_requests, sampling_hash


class GenerationError(RuntimeError):
    pass


@dataclass
class GenerationStats:
    prompts: int = 0
    requests: int = 0  # prompts x n
    distinct_requests: int = 0
    cache_hits: int = 0  # distinct requests found in the cache
    recovered_rows: int = 0  # rows sealed from spools a killed run left behind
    generated: int = 0  # distinct requests newly generated (paid for in this run)
    failed: int = 0  # distinct requests that produced an error (not cached; asked again next run)
    retries: int = 0
    retry_reasons: dict = field(default_factory=dict)
    http_requests: int = 0
    prompt_tokens: int = 0  # over all rows
    completion_tokens: int = 0
    new_prompt_tokens: int = 0  # over the generations paid for in this run
    new_completion_tokens: int = 0
    wall_s: float = 0.0
    generate_s: float = 0.0  # time the backend spent generating (GPU-seconds per device)
    cache_shards_written: int = 0
    finish_reasons: dict = field(default_factory=dict)
    compute_dtype: str | None = None  # a local model's resolved dtype (None: nothing generated locally)

    @property
    def rows_per_s(self) -> float:
        return self.generated / self.generate_s if self.generate_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_completion_tokens / self.generate_s if self.generate_s > 0 else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"rows_per_s": self.rows_per_s, "tokens_per_s": self.tokens_per_s}


@dataclass
class GenerationResult:
    rows: list[dict]
    stats: GenerationStats


def _cache_row(req: GenRequest, c: Completion, backend: Backend) -> dict:
    import json

    return {"key": req.key, "input": json.dumps(list(req.messages)) if req.messages is not None else req.prompt,
            "sample_index": req.sample_index, "completion": c.text, "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens, "latency_s": c.latency_s,
            "retries": c.retries, "top_logprobs": c.top_logprobs, "completion_token_ids": c.token_ids,
            "backend": backend.name, "model": backend.model, "teacher_identity": backend.identity,
            "created_at": time.time(), "error": c.error}


def open_requests(prompts: Sequence[dict], identity: str, sampling: Sampling, cache: GenerationCache, *,
                  chat: bool = False, context: Sequence[dict] = (), context_categories: Sequence[str] | None = None,
                  log: Callable[[str], None] = lambda _m: None, recover: Callable[[], int] | None = None):
    """The opening every executor shares (here, :func:`run_generation`; on Ray,
    :func:`campaign_orchestrator.generation.scaleout.stage.run_generation_ray`): the requests (``n`` per prompt)
    and their keys, spools a killed run left sealed (``recover``: an executor's own spools too), the cache
    compacted and every distinct key looked up. Returns ``(stats, requests per prompt, key counts, cache hits)``."""
    if not prompts:
        raise GenerationError("no prompts to generate for: the prompt table is empty")
    st = GenerationStats(prompts=len(prompts))
    with_context = None if context_categories is None else [p.get("category") in context_categories for p in prompts]
    reqs = build_requests(identity, sampling, [p["prompt"] for p in prompts], chat, context, with_context)
    st.requests = sum(len(r) for r in reqs)
    st.recovered_rows = cache.recover() + (recover() if recover is not None else 0)
    if st.recovered_rows:
        log(f"recovered {st.recovered_rows} generations a previous run finished before it stopped")
    cache.compact()
    per_key = Counter(r.key for rs in reqs for r in rs)
    st.distinct_requests = len(per_key)
    found = cache.lookup(per_key)
    st.cache_hits = len(found)
    return st, reqs, per_key, found


def assemble_rows(prompts: Sequence[dict], reqs, results: dict[str, dict], from_cache: Callable[[str], bool],
                  sampling: Sampling, st: GenerationStats) -> list[dict]:
    """The closing every executor shares: one row per (prompt, sample) in prompt order from ``results`` (cache
    rows by key; errors carry ``error``), with the stats' token totals, retries and finish reasons."""
    shash = sampling_hash(sampling)
    rows = []
    finish: Counter[str] = Counter()
    for p, rs in zip(prompts, reqs, strict=True):
        for r in rs:
            c = results[r.key]
            cached = from_cache(r.key)
            rows.append({"id": p["id"], "sample_index": r.sample_index, "prompt": p["prompt"],
                         "completion": c["completion"], "finish_reason": c["finish_reason"],
                         "prompt_tokens": c["prompt_tokens"], "completion_tokens": c["completion_tokens"],
                         "latency_s": c["latency_s"], "backend": c["backend"], "model": c["model"],
                         "sampling_hash": shash, "request_key": r.key, "from_cache": cached,
                         "retries": 0 if cached else c["retries"], "error": c.get("error"),
                         "completion_token_ids": c["completion_token_ids"], "top_logprobs": c["top_logprobs"]})
            finish[c["finish_reason"]] += 1
            st.prompt_tokens += c["prompt_tokens"] or 0
            st.completion_tokens += c["completion_tokens"] or 0
            if not cached:
                st.retries += c["retries"] or 0
    st.finish_reasons = dict(finish)
    return rows


def run_generation(prompts: Sequence[dict], backend: Backend, sampling: Sampling, cache: GenerationCache, *,
                   chat: bool = False, context: Sequence[dict] = (), context_categories: Sequence[str] | None = None,
                   progress: Callable[[int], None] | None = None,
                   log: Callable[[str], None] | None = None, budget=None) -> GenerationResult:
    """``prompts`` are dicts with ``id`` and ``prompt``. Returns rows in ``GENERATION_SCHEMA``
    (see :mod:`campaign_orchestrator.generation.rows`), ``n`` per prompt, in prompt order."""
    log = log or (lambda _m: None)
    t_start = time.perf_counter()
    st, reqs, per_key, results = open_requests(prompts, backend.identity, sampling, cache, chat=chat, context=context,
                                               context_categories=context_categories, log=log)
    missing: dict[str, GenRequest] = {}
    for rs in reqs:
        for r in rs:
            if r.key not in results and r.key not in missing:
                missing[r.key] = r
    log(f"{st.requests} requests ({st.distinct_requests} distinct): {st.cache_hits} cache hits ($0), "
        f"{len(missing)} to generate with {backend.name} {backend.model}")
    if progress and st.cache_hits:
        progress(sum(per_key[k] for k in results))  # shown as done; never charged
    if budget is not None and missing:
        budget.check_planned(len(missing) / st.distinct_requests)
    answered = 0
    timed = 0.0  # generation seconds already charged

    def on_done(req: GenRequest, c: Completion) -> None:
        nonlocal answered, timed
        row = _cache_row(req, c, backend)
        if c.ok:
            writer.add({k: v for k, v in row.items() if k != "error"})
            st.generated += 1
            st.new_prompt_tokens += c.prompt_tokens or 0
            st.new_completion_tokens += c.completion_tokens or 0
        else:
            st.failed += 1
        results[req.key] = row
        answered += 1
        if progress:
            progress(per_key[req.key])
        if budget is not None:  # what this answer cost: its tokens (an API), the time generating (local hardware)
            elapsed = time.perf_counter() - t_gen
            seconds, timed = max(0.0, elapsed - timed), max(timed, elapsed)
            budget.charge(prompt_tokens=c.prompt_tokens or 0, completion_tokens=c.completion_tokens or 0,
                          seconds=seconds, final=answered >= len(missing))

    writer = cache.writer()
    t_gen = time.perf_counter()
    g0 = getattr(backend, "generate_s", None)
    try:
        if missing:
            backend.run(list(missing.values()), sampling, on_done)
    except BaseException:
        try:
            writer.close()
            log(f"generation stopped; {st.generated} new generations finished and are kept in the cache "
                f"({cache.store.url}); a re-run continues from there")
        except Exception as e:  # keep the original error; the spool still holds the rows
            log(f"generation stopped, and sealing the cache failed too ({e})")
        raise
    if not missing:
        st.generate_s = 0.0
    elif g0 is not None:  # the backend's own clock: model time only (no loading, no cache lookups)
        st.generate_s = backend.generate_s - g0
    else:
        st.generate_s = time.perf_counter() - t_gen
    writer.close()
    st.cache_shards_written = writer.shards_written
    bstats = backend.stats()
    st.http_requests = bstats.get("http_requests", 0)
    st.retry_reasons = bstats.get("retry_reasons", {})
    st.compute_dtype = bstats.get("compute_dtype")

    unanswered = [k for k in missing if k not in results]
    if unanswered:
        raise GenerationError(f"backend {backend.name} returned no result for {len(unanswered)} requests")
    rows = assemble_rows(prompts, reqs, results, lambda key: key not in missing, sampling, st)
    st.wall_s = time.perf_counter() - t_start
    if st.failed and st.failed == len(missing) and not st.cache_hits:
        first = next(r["error"] for r in rows if r["error"])
        raise GenerationError(f"every one of {st.failed} requests failed; first error: {first}")
    return GenerationResult(rows, st)


def cached_answers(backend: Backend, cache_for: Callable[[Sampling], GenerationCache],
                   log: Callable[[str], None] | None = None,
                   on_stats: Callable[[GenerationStats], None] | None = None) -> Callable:
    """``generate(prompts, max_new_tokens)`` as evaluation asks a local model (greedy, the suite's length),
    through the generation cache (``cache_for(sampling)``): each distinct request is generated once per
    ``backend.identity``, so a re-run, another candidate's evaluation (the base is answered once) or another
    role over the same weights (a context-distillation teacher's bare prompts are the base's) finds it there.
    Completions carry ``text``, ``latency_s`` and ``error``; ``on_stats`` sees each call's
    :class:`GenerationStats` (cache hits, generated, compute dtype)."""

    def generate(prompts: Sequence[str], max_new_tokens: int) -> list:
        sampling = Sampling(max_new_tokens=max_new_tokens)
        rows = [{"id": str(i), "prompt": p} for i, p in enumerate(prompts)]
        res = run_generation(rows, backend, sampling, cache_for(sampling), log=log)
        if on_stats is not None:
            on_stats(res.stats)
        return answers(res.rows)

    return generate


def answers(rows: Sequence[dict]) -> list:
    """Generation rows as evaluation reads a model's answers: ``text``, ``latency_s``, ``error`` per row."""
    from types import SimpleNamespace

    return [SimpleNamespace(text=r["completion"] or "", latency_s=float(r["latency_s"] or 0.0), error=r["error"])
            for r in rows]
