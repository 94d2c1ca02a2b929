"""``training.compile: auto`` on a CPU: the decoder layers are compiled only where a measurement on this host says
it pays, as the attention kernel (``training.attention``) and the compute dtype (``campaign_orchestrator.hardware``)
are chosen.

On a CPU, inductor's warm-up is long (graph capture, then C++ code generation and a gcc build, once at the first
sequence length and once more for the dynamic graph: docs/results.md, "torch.compile on a CPU") and every training
process pays it; the steps after it are not always faster. So ``auto`` compiles only where both hold, measured at
the run's shape:

* a compiled step is faster: a probe model of the student's architecture with two decoder layers (random weights,
  its LoRA targets, the compute dtype, the attention kernel; a 256-token vocabulary) trains one micro-batch of the
  run's tokens, forward and backward, compiled with inductor and eager (a twin with the same weights), taking turns
  round by round, best of ``ROUNDS`` each. Two layers, because the first layer's input needs no gradient (the
  embeddings are frozen) and the others' does: the compiler builds a graph for each, as in the whole model;
* the run pays the warm-up back: ``layers / 2 × micro-steps × (eager − compiled)`` above the probe's measured
  warm-up (every graph: static ones, then the dynamic ones a second sequence length brings; on SmolLM2 the probe's
  104 s against the whole trainer's 148-246 s from an empty inductor cache and 38-45 s from a warm one: docs/results.md,
  "torch.compile on a CPU").

Before compiling anything, the probe asks whether the run could pay a warm-up back at all. Its decoder layers take
``layers / 2 × micro-steps × eager`` seconds eager, and a compiled step of no time at all saves no more than that; a
warm-up costs at least the capture inductor starts with (dynamo's capture of the layers and AOTAutograd's of their
joint forward and backward, partitioned: the ``aot_eager`` backend, measured here, without inductor's code generation
and build). A run below that floor is decided without inductor, in a few seconds; the floor is an empty cache's
(inductor's on-disk caches can make a later warm-up shorter), so a borderline run stays eager.

The figures are measured once per host, torch, threads, dtype, layer shape, LoRA, attention and tokens, by one
process of the host under a lock, and cached in ``$CAMPAIGN_CACHE_DIR/compile_choice.json``
(``campaign_orchestrator.hardware.measured_once``); what a run decides from them depends on its length too, and is
reported in its ``summary.json`` (``compile.auto``). On CUDA ``auto`` compiles without measuring
(``TrainingSpec.compiling``). A 4-bit base is not measured (the probe builds plain layers): ``auto`` leaves it eager.
``benchmarks/train_compile.py`` measures the whole trainer both ways beside what this probe decides.
"""

from __future__ import annotations

import copy
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CACHE_FILE = "compile_choice.json"
ROUNDS = 5
GRAPHS = 2  # training.model.compile_layers: a static graph at the first sequence length, then a dynamic one
PROBE_LAYERS = 2
PROBE_VOCAB = 256
PROBE_ATTENTION = ("eager", "sdpa")  # a student on another kernel (auto, segment_eager, ...) is probed on sdpa


@dataclass(frozen=True)
class CompileChoice:
    """What ``compile: auto`` resolved to on a CPU, why, and the measurement it read."""

    compile: bool
    why: str
    layers: int
    micro_steps: int
    tokens: int
    measured: dict
    measured_now: bool

    def as_dict(self) -> dict:
        return asdict(self)


def probe_model(config, student, dtype: torch.dtype, attention: str):
    """The student's architecture with ``PROBE_LAYERS`` decoder layers and a ``PROBE_VOCAB``-token vocabulary, random
    weights in ``dtype``, frozen, with the student's LoRA (PEFT, as ``training.model.load_student`` adds it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from training import moe

    cfg = copy.deepcopy(config)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.num_hidden_layers = PROBE_LAYERS
    text.vocab_size = PROBE_VOCAB
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(text, k, None), int) and getattr(text, k) >= PROBE_VOCAB:
            setattr(text, k, None)
    if hasattr(text, "layer_types") and text.layer_types:
        text.layer_types = text.layer_types[:PROBE_LAYERS]
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(**moe.lora_kwargs(student, model.config)))
    return model.train()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _batch(tokens: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PROBE_VOCAB, (1, tokens), generator=g)
    return {"input_ids": ids, "position_ids": torch.arange(tokens)[None], "use_cache": False}


def _step(model, batch: dict) -> None:
    model(**batch).logits.float().sum().backward()
    model.zero_grad(set_to_none=True)


def _probe(*args):
    torch.manual_seed(0)  # every probe model of one measurement has the same weights
    return probe_model(*args)


def measure_eager(config, student, dtype: torch.dtype, attention: str, tokens: int) -> dict:
    """``eager_s``: one step of the probe model, best of ``ROUNDS`` after a warm-up; ``capture_s``: what capturing its
    decoder layers costs (``aot_eager``: dynamo's capture of the forward and AOTAutograd's of the joint forward and
    backward, partitioned, run without code generation: what inductor does first, on an empty cache), at one
    sequence length."""
    from training.model import compile_layers

    with torch.random.fork_rng(devices=[]):
        model, batch = _probe(config, student, dtype, attention), _batch(tokens)
        _step(model, batch)
        eager = min(_timed(lambda: _step(model, batch)) for _ in range(ROUNDS))
        compile_layers(model, "aot_eager")
        try:
            capture = max(0.0, _timed(lambda: _step(model, batch)) - eager)
        finally:
            torch._dynamo.reset()
    return {"eager_s": round(eager, 6), "capture_s": round(capture, 6)}


def measure_inductor(config, student, dtype: torch.dtype, attention: str, tokens: int) -> dict:
    """``warmup_s``: the probe model's compiling steps with its decoder layer on inductor (the first sequence length,
    then another: the dynamic graph); then ``eager_s`` and ``compiled_s``: a step of an eager twin (same weights) and
    of the compiled model, taking turns round by round (a busy spell falls on both alike), best of ``ROUNDS`` each."""
    from training.model import compile_layers

    with torch.random.fork_rng(devices=[]):
        eager_model, model = (_probe(config, student, dtype, attention) for _ in range(2))
        batch, other = _batch(tokens), _batch(max(1, tokens - 1))
        compile_layers(model, "inductor")
        try:
            warmup = _timed(lambda: _step(model, batch)) + _timed(lambda: _step(model, other))
            _step(eager_model, batch)
            times: dict[str, list[float]] = {"eager_s": [], "compiled_s": []}
            for _ in range(ROUNDS):
                times["eager_s"].append(_timed(lambda: _step(eager_model, batch)))
                times["compiled_s"].append(_timed(lambda: _step(model, batch)))
        finally:
            torch._dynamo.reset()
    return {k: round(min(v), 6) for k, v in times.items()} | {"warmup_s": round(warmup, 3)}


def _key(config, student, dtype: torch.dtype, attention: str, tokens: int) -> str:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    shape = (
        getattr(text, "model_type", "?"),
        text.hidden_size,
        getattr(text, "intermediate_size", None),
        heads,
        getattr(text, "num_key_value_heads", None) or heads,
        getattr(text, "head_dim", None) or text.hidden_size // heads,
    )
    lora = (
        student.lora.r,
        "+".join(sorted(student.lora.target_modules)),
        "+".join(sorted(student.lora.target_parameters or ())),
        student.lora.use_dora,
    )
    parts = (socket.gethostname(), torch.__version__, torch.get_num_threads(), "cpu", str(dtype)[6:], *shape, *lora)
    return "|".join(map(str, (*parts, attention, tokens)))


def choose(
    config,
    student,
    dtype: torch.dtype,
    tokens: int,
    micro_steps: int,
    cache_dir: str | Path | None = None,
) -> CompileChoice:
    """Whether a CPU run of ``micro_steps`` micro-steps (per rank) of ``tokens`` tokens each trains faster compiled,
    for a student of ``config`` (its decoder layers, its LoRA) in ``dtype``: the rule in the module's docstring."""
    from campaign_orchestrator.hardware import cache_dir as host_cache_dir
    from campaign_orchestrator.hardware import measured_once

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    attention = student.attn_implementation if student.attn_implementation in PROBE_ATTENTION else "sdpa"
    path = Path(cache_dir or host_cache_dir()) / CACHE_FILE
    key = _key(config, student, dtype, attention, tokens)
    args = (config, student, dtype, attention, tokens)
    first, now = measured_once(path, key + "|eager", lambda: measure_eager(*args))
    measured = {"attention": attention, "capture_s": first["capture_s"]}
    share = layers / PROBE_LAYERS  # the run's decoder layers, in probe models
    run_eager = share * micro_steps * first["eager_s"]
    floor = GRAPHS * first["capture_s"]

    def done(compile_: bool, why: str) -> CompileChoice:
        return CompileChoice(compile_, why, layers, micro_steps, tokens, measured, now)

    if run_eager <= floor:
        measured["eager_s"] = first["eager_s"]
        return done(
            False,
            f"the run's {layers} decoder layers take ~{run_eager:.1f} s eager ({micro_steps} micro-steps of {tokens} "
            f"tokens), no more than compiling them costs at least ({GRAPHS} graphs x {first['capture_s']:.2f} s of "
            "capture before inductor's code generation): inductor not measured",
        )
    ind, now_ind = measured_once(path, key + "|inductor", lambda: measure_inductor(*args))
    measured |= ind
    now = now or now_ind
    saved = share * micro_steps * (ind["eager_s"] - ind["compiled_s"])
    figures = (
        f"a {PROBE_LAYERS}-layer probe's step {ind['eager_s'] * 1e3:.1f} ms eager, {ind['compiled_s'] * 1e3:.1f} ms "
        "compiled; "
        f"warm-up {ind['warmup_s']:.1f} s; {layers} layers x {micro_steps} micro-steps"
    )
    if ind["compiled_s"] >= ind["eager_s"]:
        return done(False, f"a compiled step is not faster here ({figures})")
    if saved <= ind["warmup_s"]:
        return done(False, f"the run would save ~{saved:.1f} s, less than the warm-up ({figures})")
    return done(True, f"the run saves ~{saved:.1f} s after the warm-up ({figures})")
