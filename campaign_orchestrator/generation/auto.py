"""``auto``: the generation engine chosen by a short measured probe, per host, device, dtype and model shape.

As the training attention kernel is chosen (``training/attention.py``), the candidates for this device run the
same small greedy workload once (synthetic prompts of the model's vocabulary, lengths spread over the context),
their new tokens per second are recorded in the host cache (``$CAMPAIGN_CACHE_DIR/generation_engines.json``,
:mod:`campaign_orchestrator.hardware`), and every later generator of that host, device, dtype and model shape
reads the record instead of measuring again. A request runs on the fastest measured engine that can serve it: one
that asks for top-k log-probabilities never runs on an engine that cannot return them (``top_logprobs`` False).
An engine that fails its probe is recorded with its error and never chosen. The choice and its reason are logged.

Candidates are the engines whose ``devices`` hold the device kind and that are usable here
(:mod:`campaign_orchestrator.generation.engines`): on a CPU the continuous engine and ``generate``
(``generate_batch`` runs there when named, but is no candidate: its module says why); on a GPU
``generate_batch``, ``generate`` and vLLM when importable (the continuous engine is CPU-tuned: its module says why
it is not a GPU candidate). Whatever the probe says, ``$CAMPAIGN_GENERATION_ENGINE``
names the engine for a whole process tree (a measurement switch).
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


def probe_key(device, dtype: str, shape: dict, names) -> str:
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
    return "|".join(map(str, parts))


def probe_prompts(
    vocab_size: int, special: set[int], n: int, context: int | None, new_tokens: int, device_type: str
) -> list[list[int]]:
    """``n`` deterministic synthetic prompts (ids outside ``special``), lengths spread from short to long."""
    import random

    rng = random.Random(0)
    lo, hi = (8, 64) if device_type == "cpu" else (32, 256)
    if context:
        hi = max(2, min(hi, context - new_tokens))
        lo = max(1, min(lo, hi))
    ids = [i for i in range(min(vocab_size, 50_000)) if i not in special] or [0]
    return [[rng.choice(ids) for _ in range(lo + (hi - lo) * j // max(1, n - 1))] for j in range(n)]


def measure(engine, prompts: list[list[int]], new_tokens: int, sync: Callable[[], None] = lambda: None) -> float:
    """New tokens per second of ``engine`` on ``prompts`` (greedy), after a two-prompt warm-up."""
    engine.generate(prompts[:2], 2)
    sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, new_tokens)
    sync()
    seconds = max(time.perf_counter() - t0, 1e-9)
    return sum(c.completion_tokens or 0 for c in out) / seconds


def probe(engines: dict, prompts: list[list[int]], new_tokens: int, sync=lambda: None) -> dict:
    """``{name: {"tokens_per_s": x}}`` or ``{name: {"error": ...}}`` for each engine."""
    rec = {}
    for name, eng in engines.items():
        try:
            rec[name] = {"tokens_per_s": round(measure(eng, prompts, new_tokens, sync), 3)}
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
) -> tuple[str | None, dict]:
    """The engine ``auto`` runs for ``gen`` (a LocalGenerator) and a request (``needs_topk``), and the record:
    measured once per host, device, dtype and model shape (cached; the first process measures under a lock
    beside the cache file, so every process of a host runs the same engine), then read."""
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
    key = probe_key(device, dtype, model_shape(gen.model), cands)
    path = Path(cache_dir or host_cache_dir()) / CACHE_FILE
    cached = read_host_cache(path)
    measured = False
    if key not in cached:
        with _host_lock(path):  # one process of the host measures; the others wait and read its record
            cached = read_host_cache(path)
            if key not in cached:
                measured = True
                n, new = PROBE.get(device.type, PROBE["cuda"])
                vocab = getattr(gen.model.config, "vocab_size", None) or len(gen.tok)
                prompts = probe_prompts(
                    vocab, set(gen.tok.all_special_ids) | set(gen.stop_ids), n, gen.context_length, new, device.type
                )
                on_gpu = device.type == "cuda" and torch.cuda.is_available()  # (a mocked device: nothing to wait for)
                sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
                cached[key] = {
                    "device": device.type,
                    "dtype": dtype,
                    "probe": {"prompts": n, "new_tokens": new},
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
