"""``auto``: the generation engine chosen by a short measured probe, per host, device, dtype and model shape.

As the training attention kernel is chosen (``training/attention.py``), the candidates for this device run the
same small greedy workload (synthetic prompts of the model's vocabulary, lengths spread over the context, each
after the shared prefix of the prompts being answered when they have one: a teacher's context, which the engines
with prefix caching prefill once); each engine is warmed up, then timed :data:`REPEATS` times and its best new
tokens per second kept (a shared host's load slows some runs, never speeds one up). The record goes to the host
cache (``$CAMPAIGN_CACHE_DIR/generation_engines.json``, :mod:`campaign_orchestrator.hardware`), and every later
generator of that host, device, dtype, model shape and prefix length reads it instead of measuring again. The first
process of a host measures under a file lock beside the cache; one started at the same time waits and reads its
record (tests/campaign_orchestrator/generation/test_auto_timings.py starts two). A request runs on the fastest
measured engine that can serve it: one that asks for top-k log-probabilities never runs on an engine that cannot
return them (``top_logprobs`` False). An engine that fails its probe is recorded with its error and never chosen.
The choice and its reason are logged.

Candidates are the engines whose ``devices`` hold the device kind and that are usable here
(:mod:`campaign_orchestrator.generation.engines`): on a CPU the continuous engine, ``generate`` and vLLM's CPU
build when it is importable (``generate_batch`` runs there when named, but is no candidate: its module says why);
on a GPU ``generate_batch``, ``generate`` and vLLM when importable (the continuous engine is CPU-tuned: its module
says why it is not a GPU candidate). Whatever the probe says, ``$CAMPAIGN_GENERATION_ENGINE`` names the engine for
a whole process tree (a measurement switch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

CACHE_FILE = "generation_engines.json"
# the probe: this many prompts x new tokens per engine (after a two-prompt warm-up), on a CPU and on a GPU
PROBE = {"cpu": (16, 16), "cuda": (64, 32)}
REPEATS = 3  # timed runs per engine after the warm-up; the best counts

_log = logging.getLogger("campaign_orchestrator.generation.local")


def candidates(device_type: str, engines: dict) -> dict:
    """The engines (name -> instance) that are candidates on ``device_type`` and usable here; why the others
    are not: ``(candidates, {name: reason})``."""
    ok, why_not = {}, {}
    for name, eng in engines.items():
        if device_type not in getattr(eng, "devices", ()):
            why_not[name] = f"not a candidate on {device_type}"
            continue
        reason = eng.unavailable()
        if reason:
            why_not[name] = reason
        else:
            ok[name] = eng
    return ok, why_not


def model_shape(model) -> dict:
    """What the probe's speed depends on in a model: its architecture's sizes."""
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    cfg = get(decoder=True) if get else cfg
    return {
        k: getattr(cfg, k, None)
        for k in (
            "model_type",
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    }


def probe_key(device, dtype: str, shape: dict, names, prefix_tokens: int = 0) -> str:
    import socket

    import torch

    dev = str(device.type)
    if dev == "cuda":
        try:
            dev += ":" + torch.cuda.get_device_name(device)
        except Exception:  # noqa: BLE001 - a mocked or vanished device: keyed by its kind
            pass
    parts = (
        socket.gethostname(),
        torch.__version__,
        torch.get_num_threads(),
        dev,
        dtype,
        ",".join(f"{k}={v}" for k, v in sorted(shape.items())),
        "+".join(sorted(names)),
    )
    key = "|".join(map(str, parts))
    return key + (f"|prefix={prefix_tokens}" if prefix_tokens else "")


PROBE_LENGTHS = {"cpu": (8, 64), "cuda": (32, 256)}  # the probe prompts' own tokens (after any shared prefix)


def fit_prefix(prefix: list[int] | None, context: int | None, new_tokens: int, device_type: str) -> list[int]:
    """``prefix`` cut to leave room in ``context`` for the shortest probe prompt and ``new_tokens``."""
    prefix = list(prefix or ())
    if context:
        prefix = prefix[: max(0, context - new_tokens - PROBE_LENGTHS.get(device_type, PROBE_LENGTHS["cuda"])[0])]
    return prefix


def probe_prompts(
    vocab_size: int,
    special: set[int],
    n: int,
    context: int | None,
    new_tokens: int,
    device_type: str,
    prefix: list[int] | None = None,
) -> list[list[int]]:
    """``n`` deterministic synthetic prompts (ids outside ``special``), lengths spread from short to long, each
    after ``prefix`` (the shared prefix of the prompts being answered: :func:`fit_prefix` cuts it)."""
    import random

    rng = random.Random(0)
    lo, hi = PROBE_LENGTHS.get(device_type, PROBE_LENGTHS["cuda"])
    prefix = fit_prefix(prefix, context, new_tokens, device_type)
    if context:
        hi = max(2, min(hi, context - new_tokens - len(prefix)))
        lo = max(1, min(lo, hi))
    ids = [i for i in range(min(vocab_size, 50_000)) if i not in special] or [0]
    return [prefix + [rng.choice(ids) for _ in range(lo + (hi - lo) * j // max(1, n - 1))] for j in range(n)]


def shared_prefix(enc: list[list[int]] | None, min_tokens: int) -> list[int]:
    """The prefix the largest group of ``enc`` shares (at least ``min_tokens`` long), or ``[]``."""
    from campaign_orchestrator.generation.engines.common import prefix_groups

    if not enc:
        return []
    groups = [(idx, n) for idx, n in prefix_groups(enc, min_tokens) if n >= min_tokens]
    if not groups:
        return []
    idx, n = max(groups, key=lambda g: (len(g[0]), g[1]))
    return list(enc[idx[0]][:n])


def measure(
    engine,
    prompts: list[list[int]],
    new_tokens: int,
    sync: Callable[[], None] = lambda: None,
    repeats: int | None = None,
) -> list[float]:
    """New tokens per second of ``engine`` on ``prompts`` (greedy) in each of ``repeats`` (default
    :data:`REPEATS`) timed runs, after a two-prompt warm-up."""
    engine.generate(prompts[:2], 2)
    sync()
    rates = []
    for _ in range(repeats or REPEATS):
        t0 = time.perf_counter()
        out = engine.generate(prompts, new_tokens)
        sync()
        seconds = max(time.perf_counter() - t0, 1e-9)
        rates.append(sum(c.completion_tokens or 0 for c in out) / seconds)
    return rates


def probe(engines: dict, prompts: list[list[int]], new_tokens: int, sync=lambda: None) -> dict:
    """``{name: {"tokens_per_s": best, "runs": [...]}}`` or ``{name: {"error": ...}}`` for each engine."""
    rec = {}
    for name, eng in engines.items():
        try:
            runs = measure(eng, prompts, new_tokens, sync)
            rec[name] = {"tokens_per_s": round(max(runs), 3), "runs": [round(r, 3) for r in runs]}
        except Exception as e:  # noqa: BLE001 - an engine that cannot run this model is recorded, never chosen
            rec[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return rec


def pick(record: dict, engines: dict, needs_topk: bool) -> tuple[str | None, str]:
    """The fastest measured engine in ``record`` that serves the request, and why."""
    speeds = {n: r["tokens_per_s"] for n, r in record.items() if "tokens_per_s" in r and n in engines}
    able = {n: s for n, s in speeds.items() if not needs_topk or getattr(engines[n], "top_logprobs", False)}
    if not able:
        return None, "no candidate engine measured" + (" that returns top-k log-probabilities" if needs_topk else "")
    best = max(able, key=able.get)
    table = ", ".join(f"{n} {s:.1f}" for n, s in sorted(speeds.items(), key=lambda kv: -kv[1]))
    left = [n for n in speeds if n not in able]
    why = f"fastest measured (new tokens/s: {table})"
    if left:
        why += f"; {', '.join(left)} left out: the request asks for top-k log-probabilities"
    return best, why


@contextmanager
def _host_lock(path: Path):
    """An exclusive lock beside the host cache file (no lock where the directory cannot be written)."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield


def choose(
    gen,
    engines: dict,
    needs_topk: bool = False,
    cache_dir: str | Path | None = None,
    device=None,
    log: Callable[[str], None] | None = None,
    prefix: list[int] | None = None,
) -> tuple[str | None, dict]:
    """The engine ``auto`` runs for ``gen`` (a LocalModel) and a request (``needs_topk``), and the record:
    measured once per host, device, dtype, model shape and ``prefix`` length (the shared prefix of the prompts
    being answered, put before every probe prompt; cached: the first process measures under a lock beside the
    cache file, so every process of a host runs the same engine), then read."""
    import torch

    from campaign_orchestrator.hardware import cache_dir as host_cache_dir
    from campaign_orchestrator.hardware import read_host_cache, write_host_cache

    device = device if device is not None else gen.device
    cands, why_not = candidates(device.type, engines)
    dtype = (
        gen.precision.dtype
        if gen.precision is not None
        else str(getattr(gen.model, "dtype", "")).removeprefix("torch.")
    )
    n, new = PROBE.get(device.type, PROBE["cuda"])
    vocab = getattr(gen.model.config, "vocab_size", None) or len(gen.tok)
    prompts = probe_prompts(
        vocab, set(gen.tok.all_special_ids) | set(gen.stop_ids), n, gen.context_length, new, device.type, prefix
    )
    prefix_tokens = len(fit_prefix(prefix, gen.context_length, new, device.type))
    key = probe_key(device, dtype, model_shape(gen.model), cands, prefix_tokens)
    path = Path(cache_dir or host_cache_dir()) / CACHE_FILE
    cached = read_host_cache(path)
    measured = False
    if key not in cached:
        with _host_lock(path):  # one process of the host measures; the others wait and read its record
            cached = read_host_cache(path)
            if key not in cached:
                measured = True
                on_gpu = device.type == "cuda" and torch.cuda.is_available()  # (a mocked device: nothing to wait for)
                sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
                cached[key] = {
                    "device": device.type,
                    "dtype": dtype,
                    "probe": {"prompts": n, "new_tokens": new, "repeats": REPEATS, "prefix_tokens": prefix_tokens},
                    "engines": probe(cands, prompts, new, sync),
                    "not_candidates": why_not,
                }
                write_host_cache(path, cached)
    record = cached[key]
    name, why = pick(record["engines"], cands, needs_topk)
    record = record | {"chosen": name, "why": why, "measured_now": measured}
    (log or _log.info)(
        f"generation engine auto -> {name} on {device.type} {dtype}: {why}" + ("" if measured else " (host cache)")
    )
    return name, record
