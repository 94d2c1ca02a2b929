"""The generation loop: prompts in, one row per (prompt, sample) out, nothing paid for twice.

:func:`run_generation` is the one entry point, whatever runs the requests:

1. Build the requests (``n`` per prompt) and their content-addressed keys.
2. Seal spools left by a killed run (the executor's own too), then look every key up in the cache.
3. Hand the missing, distinct requests to the **executor**: :class:`LocalExecutor` (a backend in this process)
   or the Ray executor (:class:`campaign_orchestrator.generation.scaleout.stage.RayExecutor`: shards on an actor
   pool). Each finished generation goes to the cache as it finishes (see
   :mod:`campaign_orchestrator.generation.cache`); failures are counted and not cached.
4. Assemble the rows in prompt order from cache hits and new results.

Money: a cache hit costs nothing. ``progress`` sees every row (hits too: it is a display); the
``budget`` (a :class:`campaign_orchestrator.costs.budget.BudgetGuard`) sees only the requests this
run pays for: first the planner's estimate for the share of requests the cache lacks
(``check_planned``), then each new generation's usage as it finishes (``charge``: the tokens the
response reports, and the seconds spent generating; on Ray, every worker's as the driver polls it).

If the executor stops with an error (a rejected key, an unreachable endpoint, a budget stop, Ctrl-C), what
finished is sealed into the cache before the error propagates: the next run continues there.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

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

    @classmethod
    def merged(cls, parts: Sequence[GenerationStats]) -> GenerationStats:
        """Several generations' stats as one (several teachers' in one stage): counts, tokens and seconds added,
        reasons counted together, the compute dtypes each named once."""
        out = cls()
        for p in parts:
            for name, value in asdict(p).items():
                if isinstance(value, dict):
                    mine = getattr(out, name)
                    for k, v in value.items():
                        mine[k] = mine.get(k, 0) + v
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    setattr(out, name, getattr(out, name) + value)
        dtypes = sorted({p.compute_dtype for p in parts if p.compute_dtype})
        out.compute_dtype = ", ".join(dtypes) or None
        return out


@dataclass
class GenerationResult:
    rows: list[dict]
    stats: GenerationStats


def _cache_row(req: GenRequest, c: Completion, backend: Backend) -> dict:
    import json

    return {
        "key": req.key,
        "input": json.dumps(list(req.messages)) if req.messages is not None else req.prompt,
        "sample_index": req.sample_index,
        "completion": c.text,
        "finish_reason": c.finish_reason,
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "latency_s": c.latency_s,
        "retries": c.retries,
        "top_logprobs": c.top_logprobs,
        "completion_token_ids": c.token_ids,
        "completion_token_strings": c.token_strings,
        "backend": backend.name,
        "model": backend.model,
        "teacher_identity": backend.identity,
        "created_at": time.time(),
        "error": c.error,
    }


def open_requests(
    prompts: Sequence[dict],
    identity: str,
    sampling: Sampling,
    cache: GenerationCache,
    *,
    chat: bool = False,
    context: Sequence[dict] = (),
    context_categories: Sequence[str] | None = None,
    log: Callable[[str], None] = lambda _m: None,
    recover: Callable[[], int] | None = None,
):
    """:func:`run_generation`'s opening, whatever the executor: the requests (``n`` per prompt)
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


def assemble_rows(
    prompts: Sequence[dict],
    reqs,
    results: dict[str, dict],
    from_cache: Callable[[str], bool],
    sampling: Sampling,
    st: GenerationStats,
) -> list[dict]:
    """:func:`run_generation`'s closing, whatever the executor: one row per (prompt, sample) in prompt order from
    ``results`` (cache rows by key; errors carry ``error``), with the stats' token totals, retries and finish
    reasons."""
    shash = sampling_hash(sampling)
    rows = []
    finish: Counter[str] = Counter()
    for p, rs in zip(prompts, reqs, strict=True):
        for r in rs:
            c = results[r.key]
            cached = from_cache(r.key)
            rows.append(
                {
                    "id": p["id"],
                    "sample_index": r.sample_index,
                    "prompt": p["prompt"],
                    "completion": c["completion"],
                    "finish_reason": c["finish_reason"],
                    "prompt_tokens": c["prompt_tokens"],
                    "completion_tokens": c["completion_tokens"],
                    "latency_s": c["latency_s"],
                    "backend": c["backend"],
                    "model": c["model"],
                    "sampling_hash": shash,
                    "request_key": r.key,
                    "from_cache": cached,
                    "retries": 0 if cached else c["retries"],
                    "error": c.get("error"),
                    "completion_token_ids": c["completion_token_ids"],
                    "completion_token_strings": c.get("completion_token_strings"),  # None in older cache files
                    "top_logprobs": c["top_logprobs"],
                }
            )
            finish[c["finish_reason"]] += 1
            st.prompt_tokens += c["prompt_tokens"] or 0
            st.completion_tokens += c["completion_tokens"] or 0
            if not cached:
                st.retries += c["retries"] or 0
    st.finish_reasons = dict(finish)
    return rows


@dataclass
class GenerationWork:
    """One run's requests as :func:`run_generation` hands them to its executor, after the shared opening:
    ``reqs`` (``n`` per prompt), ``per_key`` (rows per distinct key), ``found`` (cache hits: key -> cache row),
    ``missing`` (the distinct requests the cache lacks, in request order) and the stats so far. An executor
    that finds rows in the cache meanwhile (a killed run's spool a worker sealed) adds them to ``found``: they
    are cache hits ($0), the rest of what it answered was paid for in this run."""

    prompts: Sequence[dict]
    reqs: list
    per_key: Counter
    found: dict[str, dict]
    missing: dict[str, GenRequest]
    sampling: Sampling
    cache: GenerationCache
    stats: GenerationStats
    log: Callable[[str], None]
    progress: Callable[[int], None] | None = None
    budget: object = None
    started_at: float = 0.0  # wall clock (time.time()) when the run started: rows created since are this run's


class Executor(Protocol):
    """What runs a generation's missing requests: :class:`LocalExecutor` (a backend in this process) or
    :class:`campaign_orchestrator.generation.scaleout.stage.RayExecutor` (shards on a Ray actor pool)."""

    identity: str  # the engine's identity: every request key hashes it
    answered_by: str  # who answers, as an error names it

    def recover(self) -> int:
        """Seal this executor's own spools a killed run left (besides the cache's own); their row count."""

    def prepare(self, work: GenerationWork) -> str:
        """Plan the work; the run log's line saying what is cached and what will be generated where."""

    def execute(self, work: GenerationWork) -> dict[str, dict]:
        """Generate ``work.missing`` into the cache, charging ``work.budget`` and telling ``work.progress`` as
        answers finish, and fill the stats of what was generated; returns every key's cache row (errors carry
        ``error``; a key left out is an error naming ``answered_by``)."""


class LocalExecutor:
    """A backend in this process: each finished generation goes to the cache writer at once, the budget is
    charged per answer (its tokens, and the seconds since the first paid request started), ``progress`` sees
    each answer's rows. If the backend stops with an error, what finished is sealed before the error propagates."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.identity = backend.identity
        self.answered_by = f"backend {backend.name}"

    def recover(self) -> int:
        return 0

    def close(self) -> None:
        """Stop the backend's engine when it has one (a ``close`` method: vLLM's engine-core process and its
        memory); a backend without one (a transformers model, an HTTP client) is left to be collected."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def prepare(self, work: GenerationWork) -> str:
        st, b = work.stats, self.backend
        return (
            f"{st.requests} requests ({st.distinct_requests} distinct): {st.cache_hits} cache hits ($0), "
            f"{len(work.missing)} to generate with {b.name} {b.model}"
        )

    def execute(self, work: GenerationWork) -> dict[str, dict]:
        backend, st, cache, missing = self.backend, work.stats, work.cache, work.missing
        progress, budget = work.progress, work.budget
        results = dict(work.found)
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
                progress(work.per_key[req.key])
            if budget is not None:  # what this answer cost: its tokens (an API), the time generating (local hardware)
                elapsed = time.perf_counter() - t_gen
                seconds, timed = max(0.0, elapsed - timed), max(timed, elapsed)
                budget.charge(
                    prompt_tokens=c.prompt_tokens or 0,
                    completion_tokens=c.completion_tokens or 0,
                    seconds=seconds,
                    final=answered >= len(missing),
                )

        writer = cache.writer()
        t_gen = time.perf_counter()
        g0 = getattr(backend, "generate_s", None)
        try:
            if missing:
                backend.run(list(missing.values()), work.sampling, on_done)
        except BaseException:
            try:
                writer.close()
                work.log(
                    f"generation stopped; {st.generated} new generations finished and are kept in the cache "
                    f"({cache.store.url}); a re-run continues from there"
                )
            except Exception as e:  # keep the original error; the spool still holds the rows
                work.log(f"generation stopped, and sealing the cache failed too ({e})")
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
        return results


def run_generation(
    prompts: Sequence[dict],
    executor: Executor | Backend,
    sampling: Sampling,
    cache: GenerationCache,
    *,
    chat: bool = False,
    context: Sequence[dict] = (),
    context_categories: Sequence[str] | None = None,
    progress: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
    budget=None,
) -> GenerationResult:
    """``prompts`` are dicts with ``id`` and ``prompt`` (and ``category``, for ``context_categories``). Returns
    rows in ``GENERATION_SCHEMA`` (see :mod:`campaign_orchestrator.generation.rows`), ``n`` per prompt, in prompt
    order. ``executor`` runs what the cache lacks: a :class:`LocalExecutor` (a bare backend is run by one) or the
    Ray executor (:class:`campaign_orchestrator.generation.scaleout.stage.RayExecutor`); ``cache`` is this
    process's view of the cache the executor writes. Whichever runs, the same requests give the same rows, the
    same cache keys and the same usage charged to ``budget``. A bare backend is this call's: its engine, if it
    has one (vLLM), is stopped when the call returns (:meth:`LocalExecutor.close`; every stage builds its backend
    for one call), so no engine process outlives its stage or keeps a process from exiting; pass a
    :class:`LocalExecutor` to keep it for more calls."""
    if hasattr(executor, "execute"):
        return _run_generation(
            prompts, executor, sampling, cache, chat, context, context_categories, progress, log, budget
        )
    local = LocalExecutor(executor)
    try:
        return _run_generation(
            prompts, local, sampling, cache, chat, context, context_categories, progress, log, budget
        )
    finally:
        local.close()


def _run_generation(
    prompts, executor, sampling, cache, chat, context, context_categories, progress, log, budget
) -> GenerationResult:
    log = log or (lambda _m: None)
    t_start, t_wall0 = time.perf_counter(), time.time()
    st, reqs, per_key, found = open_requests(
        prompts,
        executor.identity,
        sampling,
        cache,
        chat=chat,
        context=context,
        context_categories=context_categories,
        log=log,
        recover=executor.recover,
    )
    missing: dict[str, GenRequest] = {}
    for rs in reqs:
        for r in rs:
            if r.key not in found and r.key not in missing:
                missing[r.key] = r
    work = GenerationWork(prompts, reqs, per_key, found, missing, sampling, cache, st, log, progress, budget, t_wall0)
    log(executor.prepare(work))
    if progress and st.cache_hits:
        progress(sum(per_key[k] for k in found))  # shown as done; never charged
    if budget is not None and missing:
        budget.check_planned(len(missing) / st.distinct_requests)
    results = executor.execute(work)
    unanswered = [k for k in per_key if k not in results]
    if unanswered:
        raise GenerationError(f"{executor.answered_by} returned no result for {len(unanswered)} requests")
    rows = assemble_rows(prompts, reqs, results, lambda key: key in work.found, sampling, st)
    st.wall_s = time.perf_counter() - t_start
    if st.failed and st.failed == len(missing) and not st.cache_hits:
        first = next(r["error"] for r in rows if r["error"])
        raise GenerationError(f"every one of {st.failed} requests failed; first error: {first}")
    return GenerationResult(rows, st)


def cached_rows(
    prompts: Sequence[dict],
    identity: str,
    sampling: Sampling,
    cache: GenerationCache,
    *,
    chat: bool = False,
    context: Sequence[dict] = (),
    context_categories: Sequence[str] | None = None,
) -> GenerationResult:
    """The rows the cache holds for ``prompts`` as ``identity`` answers them, asking nothing: the prompts whose every
    sample is in the cache (what a stopped run finished: paid for, sealed), the others left out. A teacher that a
    budget stopped keeps these in its stage's output."""
    if not prompts:
        return GenerationResult([], GenerationStats())
    st, reqs, per_key, found = open_requests(
        prompts, identity, sampling, cache, chat=chat, context=context, context_categories=context_categories
    )
    whole = [i for i, rs in enumerate(reqs) if all(r.key in found for r in rs)]
    kept, kept_reqs = [prompts[i] for i in whole], [reqs[i] for i in whole]
    st.prompts = len(kept)
    rows = assemble_rows(kept, kept_reqs, found, lambda _key: True, sampling, st)
    return GenerationResult(rows, st)


def cached_answers(
    backend: Backend,
    cache_for: Callable[[Sampling], GenerationCache],
    log: Callable[[str], None] | None = None,
    on_stats: Callable[[GenerationStats], None] | None = None,
) -> Callable:
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

    return [
        SimpleNamespace(text=r["completion"] or "", latency_s=float(r["latency_s"] or 0.0), error=r["error"])
        for r in rows
    ]
