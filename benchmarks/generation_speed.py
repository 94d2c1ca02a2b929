"""Benchmark: LocalModel's continuous engine (forward + DynamicCache: finished rows leave the batch,
waiting prompts take their room, prompts sharing a prefix share its prefill) against the ``transformers``
``generate`` path, on the same prompts in the same run.

    python benchmarks/generation_speed.py [--prompts 96] [--dtype auto] [--threads 1] [--tiny] [--out r.json]

Sections: ``teacher`` (campaigns/smollm2.yaml's teacher stage: its 391 training prompts, the plural ones under
the few-shot context, greedy, 64 new tokens, top-20 logprobs, batch 32) and ``evaluation`` (what the evaluation
stage generates: candidate, base and teacher each answer both suites, plurals 120 items with 8 new tokens and
general 150 with 32, batch 32; the teacher answers the plural items under its few-shot context, as the stage asks
it). The candidate is the base with ``--adapter DIR`` (a trained student adapter, e.g. a ``make real`` run's);
without one the base stands in for it (same weights and cost per token; its answers are the base's longer ones,
so the stand-in understates what stopping rows early saves). ``--prompts N`` takes an even subset (N teacher
prompts, at most N items per suite). Each (section, engine) runs in its own process, so peak RSS is its own;
``--repeats R`` runs the pairs R times, old and new alternating (a shared machine's load then falls on both).
``--tiny``: the demo teacher on cipher prompts (a test of the script; speed goals are not judged).

Judged on wall time (exit 1 when missed; the CPU-seconds ratio, which a shared machine's load distorts less, is
reported beside it): outputs token-identical to ``generate`` (in bf16, where no batched path is token-identical
to another: padding and batch mates flip near-ties, the section is also answered in fp32, the model's answer without
bf16 rounding; on the prompts where the two engines differ, the new one fails only when it agrees with the fp32 answer
less often than ``generate`` by a one-sided sign test at p < 0.05: which engine wins a few more near-ties changes from
run to run with the batches), teacher >= 3x prompts/s, evaluation >= 2x, peak RSS <= 1.2x.

``engines`` (the section ``--device cuda`` runs by default): every local engine side by side, and ``auto``'s
choice, on ``--device``, at each of ``--shapes``: ``llama-1.1b`` (TinyLlama's shape, random weights in the device's
dtype; 256 prompts of 32-256 random tokens x 128 new tokens, greedy; the default on cuda), ``demo-teacher`` (cipher
prompts x 16 new tokens) and ``smollm2`` (SmolLM2-135M-Instruct, the smollm2 campaign's training prompts rendered
as its teacher asks them, the plural ones under its few-shot context, x 32 new tokens; the default on a CPU with
``demo-teacher``). Per engine: new tokens/s, seconds, share of answers token-identical to ``hf_generate``'s, and
the seconds of its first (warm-up) call, which for vLLM include starting its engine; ``auto``: the engine its probe
chose, why, and its tokens/s as a run through ``auto``. Reported against the GPU goals (not judged on a CPU):
``auto`` within 5% of the fastest engine at each shape, and the local path at 1.1B >= 1.5x ``hf_generate``'s
tokens/s. Without CUDA, ``--device cuda`` records the section as skipped (exit 0). vLLM runs where it is importable
and computes on ``--device``: its GPU package on cuda, its CPU build (``make vllm-venv``; run this script with
``.venv-vllm/bin/python``) on cpu, where its engine core binds its own threads (one core of two here, the other
kept for the calling process).

    python benchmarks/generation_speed.py --device cuda [--out r.json]
    .venv-vllm/bin/python benchmarks/generation_speed.py --sections engines --device cpu [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GOALS = {"teacher": 3.0, "evaluation": 2.0}
MEMORY_GOAL = 1.2
TINY_HEADER = "ab=cd ef=gh ij=kl "


SIGN_TEST_ALPHA = 0.05


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test: the chance of ``wins`` or fewer among ``wins + losses`` prompts where exactly one
    of two engines gives the fp32 answer, were both equally faithful. bf16 near-ties flip with the batch a prompt
    shares, so which engine wins a handful more is noise from run to run; only a small p says the new one is
    less faithful."""
    from math import comb

    n = wins + losses
    return 1.0 if n == 0 else sum(comb(n, k) for k in range(wins + 1)) / 2**n


def _subset(rows: list, n: int | None) -> list:
    if not n or n >= len(rows):
        return rows
    step = len(rows) / n
    return [rows[int(i * step)] for i in range(n)]


def workload(section: str, n: int | None, tiny: bool) -> list[dict]:
    """[{name, prompts, max_new_tokens, logprobs, batch_size}] of a section."""
    if tiny:
        from campaign_orchestrator.demo import cipher

        items = [it["prompt"] for it in cipher.items(24, seed=7, id_prefix="b")]
        if section == "teacher":
            ps = [TINY_HEADER + p if i % 2 else p for i, p in enumerate(items)]
            return [
                {"name": "teacher", "prompts": _subset(ps, n), "max_new_tokens": 16, "logprobs": 3, "batch_size": 8}
            ]
        return [
            {"name": "cipher", "prompts": _subset(items, n), "max_new_tokens": 8, "logprobs": None, "batch_size": 8}
        ]
    import yaml

    from campaign_orchestrator.dataset.prompts import split
    from campaign_orchestrator.generation.requests import chat_messages

    spec = yaml.safe_load((REPO / "campaigns" / "smollm2.yaml").read_text())
    data = REPO / "campaigns" / "data" / "smollm2"
    if section == "teacher":
        t = spec["teacher"]
        rows = [
            json.loads(x) for f in sorted(data.glob("train-*.jsonl")) for x in f.read_text().splitlines() if x.strip()
        ]
        ho = spec["data"]["heldout"]
        train, _ = split(rows, ho["fraction"], ho["seed"])
        ps = [
            list(chat_messages(r["prompt"], t["context"]))
            if r.get("category") in t["context_categories"]
            else r["prompt"]
            for r in train
        ]
        return [
            {
                "name": "teacher",
                "prompts": _subset(ps, n),
                "max_new_tokens": t["sampling"]["max_new_tokens"],
                "logprobs": t["sampling"]["logprobs"],
                "batch_size": t["batch_size"],
            }
        ]
    t, suites = spec["teacher"], spec["evaluation"]["suites"]
    eval_batch = max(s["batch_size"] for s in suites)  # assets/evaluation.py: one generator for every suite
    out = []
    for role in ("candidate", "base", "teacher"):
        for s in suites:
            items = _subset([json.loads(x) for x in (REPO / s["source"]).read_text().splitlines() if x.strip()], n)
            prompts = [
                list(chat_messages(it["prompt"], t["context"]))
                if role == "teacher" and it.get("category") in t["context_categories"]
                else it["prompt"]
                for it in items
            ]
            out.append(
                {
                    "name": f"{role}/{s['name']}",
                    "role": role,
                    "prompts": prompts,
                    "max_new_tokens": s["max_new_tokens"],
                    "logprobs": None,
                    "batch_size": t["batch_size"] if role == "teacher" else eval_batch,
                    # as the stage asks through the generation cache: the bare items, the teacher's context
                    "rows": [
                        {"id": str(i), "prompt": it["prompt"], "category": it.get("category")}
                        for i, it in enumerate(items)
                    ],
                    "context": t["context"] if role == "teacher" else [],
                    "context_categories": t["context_categories"] if role == "teacher" else None,
                }
            )
    return out


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def worker(a) -> int:
    import gc

    import torch

    torch.set_num_threads(a.threads)
    from campaign_orchestrator.generation.local import LocalModel
    from campaign_orchestrator.process_memory import peak_rss_mb

    lines: list[str] = []
    jobs = workload(a.section, a.prompts, a.tiny)
    loaded: dict = {}

    def generator(role: str | None):
        """The role's generator; the candidate carries ``--adapter`` (merged), the others are the plain model.
        One model is in memory at a time, as in the evaluation stage."""
        adapter = a.adapter if role == "candidate" else None
        if adapter not in loaded:
            loaded.clear()
            gc.collect()
            g = LocalModel.from_path(a.model, adapter, compute_dtype=a.dtype, device="cpu", engine=a.engine)
            g.log = lines.append
            loaded[adapter] = g
        return loaded[adapter]

    gen = generator(jobs[0].get("role"))
    gen.batch_size = jobs[0]["batch_size"]
    gen.generate(jobs[0]["prompts"][:4], 4, logprobs=jobs[0]["logprobs"])  # warm-up (lazy init, probes)
    staged = None
    if a.section == "evaluation" and not a.tiny and a.engine == "continuous" and not a.engine_only:
        import tempfile

        staged = _StageAnswers(a, generator, Path(tempfile.mkdtemp(prefix="genbench-cache-")))
    base = _rss_mb()
    out = {"engine": gen.engine, "dtype": gen.precision.dtype, "threads": torch.get_num_threads(), "suites": {}}
    total_s = total_cpu = n_prompts = n_tokens = 0
    for j in jobs:
        gen = None  # the previous role's model is released before the next loads, as in the stage
        gen = generator(j.get("role"))
        gen.batch_size = j["batch_size"]
        t0, c0 = time.perf_counter(), time.process_time()
        if staged is not None:
            res, hits = staged.answer(j), staged.last_hits
        else:
            res, hits = gen.generate(j["prompts"], j["max_new_tokens"], logprobs=j["logprobs"]), 0
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        total_cpu += cpu
        toks = sum(c.completion_tokens or 0 for c in res)
        total_s, n_prompts, n_tokens = total_s + dt, n_prompts + len(res), n_tokens + toks
        out["suites"][j["name"]] = {
            "prompts": len(res),
            "seconds": round(dt, 3),
            "cpu_seconds": round(cpu, 3),
            "completion_tokens": toks,
            "from_cache": hits,
            "errors": sum(not c.ok for c in res),
            "shared_prefix": gen.last_shared_prefix,
            "token_ids": [c.token_ids for c in res],
        }
    peak = peak_rss_mb()  # the worker's own: ru_maxrss would start from this script's parent's peak
    out.update(
        seconds=round(total_s, 3),
        cpu_seconds=round(total_cpu, 3),
        prompts=n_prompts,
        completion_tokens=n_tokens,
        prompts_per_s=round(n_prompts / total_s, 3),
        tokens_per_s=round(n_tokens / total_s, 1),
        peak_rss_mb=round(peak, 1),
        rss_before_mb=round(base, 1),
        log=lines[-3:],
    )
    print(json.dumps(out))
    return 0


class _StageAnswers:
    """The evaluation stage's path (assets/evaluation.py): each role answers through the generation cache (here an
    empty one under ``root``) under its content identity: the candidate's (base weights + adapter), the base's, the
    teacher's as ``teacher_setup`` keys it. The teacher of campaigns/smollm2.yaml is the base's weights and dtype, so
    its bare-prompt answers (the general suite) are found under the base's; its plural items (under its context)
    are generated."""

    def __init__(self, a, generator, root: Path):
        from campaign_orchestrator.content import HashCache, model_fingerprint
        from campaign_orchestrator.generation.backends import answer_identity, teacher_identity
        from campaign_orchestrator.generation.blobstore import open_store
        from campaign_orchestrator.hardware import key_precision
        from campaigns import paths

        self.generator, self.root, self.store = generator, root, open_store(root / "cache")
        self.model_path = a.model
        hashes = HashCache(paths.hash_cache_file())
        precision = key_precision(a.dtype)
        weights = f"{model_fingerprint(Path(a.model), hashes)}@"
        # the stand-in candidate (no --adapter) is still another model to the stage: never the base's answers
        adapter = model_fingerprint(Path(a.adapter), hashes)[:20] if a.adapter else "stand-in-candidate"
        self.identity = {
            role: answer_identity(
                str(a.model),
                a.model,
                weights_id=weights,
                precision=precision,
                adapter_id=adapter if role == "candidate" else None,
            )
            for role in ("candidate", "base")
        }
        # the teacher keyed as teacher_setup keys a transformers teacher (spec_identity), not assumed to be the base
        self.identity["teacher"] = teacher_identity(
            "transformers", str(a.model), a.model, weights_id=weights, precision=precision
        )
        self.last_hits = 0

    def answer(self, job: dict) -> list:
        from types import SimpleNamespace

        from campaign_orchestrator.generation.backends import TransformersBackend
        from campaign_orchestrator.generation.cache import GenerationCache
        from campaign_orchestrator.generation.requests import Sampling, namespace
        from campaign_orchestrator.generation.runner import run_generation

        role, ident = job["role"], self.identity[job["role"]]
        gen = self.generator(role)
        gen.batch_size = job["batch_size"]
        backend = TransformersBackend(self.model_path, f"benchmark ({role})", ident, local_model=gen)
        sampling = Sampling(max_new_tokens=job["max_new_tokens"])
        res = run_generation(
            job["rows"],
            backend,
            sampling,
            GenerationCache(self.store, namespace(ident, sampling), self.root / "spool"),
            context=job["context"],
            context_categories=job["context_categories"],
        )
        self.last_hits = res.stats.cache_hits
        return [
            SimpleNamespace(
                token_ids=r["completion_token_ids"], completion_tokens=r["completion_tokens"], ok=r["error"] is None
            )
            for r in res.rows
        ]


LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
ENGINE_GOALS = {"auto_within_fastest": 0.95, "local_vs_hf_generate_1b": 1.5}


def _llama_1b(root: Path, tokenizer_dir: Path, dtype: str) -> Path:
    """A 1.1B-shaped Llama with random weights saved under ``root`` (with the demo tokenizer: random prompts are
    token ids, so only decoding uses it)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = root / "llama-1.1b"
    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = LlamaConfig(
        **LLAMA_1B, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    del model
    return out


def _random_prompts(n: int, lo: int, hi: int, vocab: int, special: set[int], seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    ids = [i for i in range(vocab) if i not in special]
    return [[rng.choice(ids) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


SHAPES = {"cuda": "llama-1.1b,demo-teacher", "cpu": "demo-teacher,smollm2"}


def _shape(name: str, a, demo: Path, dev: str):
    """``(path, prompts as rendered ids or None, (n, lo, hi, new tokens, batch))`` of an ``engines`` shape."""
    if name == "llama-1.1b":
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="genbench-1b-"))
        return _llama_1b(root, demo, "bfloat16" if dev == "cuda" else "float32"), None, (256, 32, 256, 128, 128)
    if name == "demo-teacher":
        return demo, None, (a.prompts or 96, 0, 0, 16, 32)
    if name == "smollm2":
        sys.path.insert(0, str(REPO / "benchmarks"))
        import _real_model

        path = _real_model.model_dir()
        prompts = workload("teacher", a.prompts or 64, False)[0]["prompts"]
        return path, prompts, (len(prompts), 0, 0, 32, 32)
    raise SystemExit(f"--shapes: unknown shape {name!r} (llama-1.1b, demo-teacher, smollm2)")


def engines_worker(a) -> int:
    """The ``engines`` section in this process: every engine and ``auto`` at each shape, on ``a.device``."""
    import torch

    from campaign_orchestrator.demo.build import build_demo_models
    from campaign_orchestrator.demo.recipe import resolve
    from campaign_orchestrator.generation.engines import ENGINE_MODULES
    from campaign_orchestrator.generation.local import LocalModel

    build_demo_models(Path(a.artifacts), log=lambda _m: None, moe=False)  # a cache hit once built
    demo = Path(resolve("@demo/teacher", a.artifacts))
    dev = a.device
    torch.set_num_threads(a.threads)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    shapes = ["demo-teacher"] if a.tiny else (a.shapes or SHAPES[dev]).split(",")
    out: dict = {"device": dev, "shapes": {}}
    for name in shapes:
        path, texts, (n, lo, hi, new, batch) = _shape(name, a, demo, dev)
        gen = LocalModel.from_path(path, compute_dtype=a.dtype, device=dev, batch_size=batch)
        if lo:
            enc = _random_prompts(n, lo, hi, gen.model.config.vocab_size, set(gen.tok.all_special_ids))
        else:
            from campaign_orchestrator.dataset.formatting import render_prompt_ids
            from campaign_orchestrator.demo import cipher

            texts = texts or [it["prompt"] for it in cipher.items(n, seed=7, id_prefix="e")]
            enc = [render_prompt_ids(gen.tok, p) for p in texts]
        rec: dict = {"model": str(path), "prompts": len(enc), "new_tokens": new, "dtype": gen.precision.dtype}
        rec["load_average_1min"] = [round(os.getloadavg()[0], 2)]  # at the start and at the end: a shared host
        rec["engines"] = {}
        ref = None
        for eng in ("hf_generate", *[e for e in ENGINE_MODULES if e != "hf_generate"]):
            inst = gen.engine_instance(eng)
            why = inst.unavailable()
            if not why and eng == "vllm" and dev not in inst.devices:
                why = f"the installed vLLM computes on {inst.devices[0]}, not {dev}"
            if eng == "continuous" and dev == "cuda" and name == "llama-1.1b":
                why = "not a candidate on cuda (CPU-tuned; its module says why): not run at this shape"
            if eng == "generate_batch" and dev == "cpu" and name == "smollm2":
                why = "not a candidate on cpu (~50x slower than the continuous engine there: its module says why)"
            if why:
                rec["engines"][eng] = {"skipped": why}
                continue
            try:
                t0 = time.perf_counter()
                inst.generate(enc[:2], 2)  # warm-up (vLLM: starting its engine)
                sync()
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                res = inst.generate(enc, new)
                sync()
                dt = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - one engine failing is a finding, not the end of the report
                rec["engines"][eng] = {"error": f"{type(e).__name__}: {e}"[:400]}
                continue
            toks = sum(c.completion_tokens or 0 for c in res)
            ids = [c.token_ids for c in res]
            ref = ids if eng == "hf_generate" else ref
            rec["engines"][eng] = {
                "seconds": round(dt, 3),
                "new_tokens": toks,
                "tokens_per_s": round(toks / dt, 1),
                "first_call_s": round(first, 3),
                "same_as_hf_generate": None
                if ref is None
                else round(sum(x == y for x, y in zip(ids, ref, strict=True)) / len(ids), 4),
            }
            if eng == "vllm":
                rec["engines"][eng]["engine_args"] = {k: v for k, v in inst.args.items() if k != "model"}
        lines: list[str] = []
        auto = LocalModel(gen.model, gen.tok, batch, gen.precision, engine="auto", log=lines.append, source=gen.source)
        auto.engines = gen.engines  # the engines measured above (a started vLLM engine is not started again)
        chosen = auto.engine_for(False, enc)  # the probe runs here, on the prompts' shared prefix (or the host cache)
        auto.engine_instance(chosen).generate(enc[:2], 2)
        sync()
        t0 = time.perf_counter()
        res = auto.engine_instance(chosen).generate(enc, new)
        sync()
        dt = time.perf_counter() - t0
        toks = sum(c.completion_tokens or 0 for c in res)
        ran = {e: r["tokens_per_s"] for e, r in rec["engines"].items() if "tokens_per_s" in r}
        rec["auto"] = {
            "chosen": chosen,
            "why": auto.choice.get(False, {}).get("why", lines[-1:] or ""),
            "probe": auto.choice.get(False, {}).get("engines"),
            "tokens_per_s": round(toks / dt, 1),
            "seconds": round(dt, 3),
        }
        if ran:
            fastest = max(ran, key=ran.get)
            rec["fastest"] = fastest
            rec["auto_vs_fastest"] = round(rec["auto"]["tokens_per_s"] / ran[fastest], 3)
            if "hf_generate" in ran:
                rec["auto_vs_hf_generate"] = round(rec["auto"]["tokens_per_s"] / ran["hf_generate"], 3)
        rec["load_average_1min"].append(round(os.getloadavg()[0], 2))
        out["shapes"][name] = rec
        for inst in list(gen.engines.values()) + list(auto.engines.values()):
            getattr(inst, "close", lambda: None)()  # vLLM's engine core goes before the next shape's
        del gen, auto
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(out))
    return 0


def engines_section(a) -> dict:
    """The ``engines`` section (its own process), or why it is skipped; goals reported, judged only on CUDA."""
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return {"skipped": "no CUDA device on this host (torch sees none): the cuda sections did not run"}
    r = _child(a, "engines", "all")
    goals = {}
    for name, rec in r["shapes"].items():
        if "auto_vs_fastest" in rec:
            goals[f"{name}: auto within 5% of the fastest ({rec['fastest']})"] = (
                rec["auto_vs_fastest"] >= ENGINE_GOALS["auto_within_fastest"]
            )
        if name == "llama-1.1b" and "auto_vs_hf_generate" in rec:
            goals["llama-1.1b: the local path >= 1.5x hf_generate's tokens/s"] = (
                rec["auto_vs_hf_generate"] >= ENGINE_GOALS["local_vs_hf_generate_1b"]
            )
    r["goals_met"] = goals
    r["judged"] = a.device == "cuda"
    return r


def _child(a, section: str, engine: str, dtype: str | None = None, engine_only: bool = False) -> dict:
    cmd = (
        [
            sys.executable,
            __file__,
            "--worker",
            "--section",
            section,
            "--engine",
            engine,
            "--model",
            str(a.model or ""),
            "--dtype",
            dtype or a.dtype,
            "--threads",
            str(a.threads),
        ]
        + (["--prompts", str(a.prompts)] if a.prompts else [])
        + (["--tiny"] if a.tiny else [])
        + (["--adapter", str(a.adapter)] if a.adapter else [])
        + (["--engine-only"] if a.engine_only or engine_only else [])
        + (["--shapes", a.shapes] if a.shapes else [])
        + ["--device", a.device, "--artifacts", str(a.artifacts)]
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"benchmark worker ({section}, {engine}) failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=None, help="an even subset: N teacher prompts, <= N items per suite")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="the demo teacher on cipher prompts (speed goals not judged)")
    ap.add_argument("--sections", default=None, help="default: teacher,evaluation (cpu); engines (cuda)")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the engines section runs (teacher and evaluation always run on the CPU)",
    )
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"))
    ap.add_argument(
        "--shapes",
        default=None,
        help="engines: llama-1.1b, demo-teacher, smollm2 (default: "
        + "; ".join(f"{d}: {v}" for d, v in SHAPES.items())
        + ")",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--adapter", default=None, help="the candidate's adapter directory (default: the base stands in)")
    ap.add_argument(
        "--engine-only",
        action="store_true",
        help="evaluation: the new engine without the stage's generation cache (no shared answers)",
    )
    ap.add_argument("--repeats", type=int, default=1, help="old/new pairs per section, alternating")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return engines_worker(a) if a.section == "engines" else worker(a)
    a.sections = a.sections or ("engines" if a.device == "cuda" else "teacher,evaluation")
    if a.tiny:
        from campaign_orchestrator.demo.build import build_demo_models
        from campaign_orchestrator.demo.recipe import resolve

        build_demo_models(Path(a.artifacts), log=lambda _m: None, moe=False)
        a.model = resolve("@demo/teacher", a.artifacts)
    elif set(a.sections.split(",")) == {"engines"}:
        a.model = None  # the engines section builds its own models (the demo teacher, a 1.1B-shaped Llama)
    else:
        sys.path.insert(0, str(REPO / "benchmarks"))
        import _real_model

        a.model = _real_model.model_dir()
        if not (Path(a.model) / "config.json").exists():
            raise SystemExit(
                f"the real model is not at {a.model}: run `.venv/bin/campaign fetch-model smollm2-135m-instruct` first"
            )
    report = {
        "benchmark": "generation_speed",
        "date": time.strftime("%Y-%m-%d"),
        "model": str(a.model),
        "new_path": "the continuous engine"
        + ("" if a.engine_only or a.tiny else "; evaluation through the stage's generation cache"),
        "tiny": a.tiny,
        "threads": a.threads,
        "prompts_option": a.prompts,
        "sections": {},
        "failed": [],
    }
    if a.adapter:
        report["candidate"] = f"the base with the adapter {a.adapter}"
    elif not a.tiny:
        report["candidate"] = "the base (stand-in: no --adapter)"
    for section in a.sections.split(","):
        if section == "engines":
            r = engines_section(a)
            report["sections"]["engines"] = r
            if r.get("judged"):
                report["failed"] += [f"engines: {goal} not met" for goal, ok in r["goals_met"].items() if not ok]
            continue
        pairs, loads = [], [os.getloadavg()[0]]
        for rep in range(a.repeats):  # old and new alternate; the first of a pair changes every repeat
            engines = ("hf_generate", "continuous") if rep % 2 == 0 else ("continuous", "hf_generate")
            got = {e: _child(a, section, e) for e in engines}
            pairs.append((got["hf_generate"], got["continuous"]))
            loads.append(os.getloadavg()[0])
        old, new = pairs[0]
        report["dtype"] = new["dtype"]
        diff: dict[str, list[int]] = {}
        for name, _s in new["suites"].items():
            diff[name] = sorted(
                {
                    i
                    for o, nw in pairs
                    for i, (x, y) in enumerate(
                        zip(nw["suites"][name]["token_ids"], o["suites"][name]["token_ids"], strict=True)
                    )
                    if x != y
                }
            )
        n_diff = sum(len(v) for v in diff.values())

        def total(engine: int, key: str, name: str | None = None, runs: list = pairs) -> float:
            return sum((p[engine]["suites"][name] if name else p[engine])[key] for p in runs)

        r = {
            "prompts": new["prompts"],
            "repeats": len(pairs),
            "load_average_1min": [round(x, 2) for x in loads],
            "new": {k: v for k, v in new.items() if k != "suites"},
            "old": {k: v for k, v in old.items() if k != "suites"},
            "per_suite": {
                n: {
                    "new_s": round(total(1, "seconds", n), 3),
                    "old_s": round(total(0, "seconds", n), 3),
                    "new_cpu_s": round(total(1, "cpu_seconds", n), 3),
                    "old_cpu_s": round(total(0, "cpu_seconds", n), 3),
                    "shared_prefix_new": s["shared_prefix"],
                    "shared_prefix_old": old["suites"][n]["shared_prefix"],
                    "completion_tokens_new": s["completion_tokens"],
                    "from_cache_new": s.get("from_cache", 0),
                    "completion_tokens_old": old["suites"][n]["completion_tokens"],
                    "differing_prompts": diff[n],
                }
                for n, s in new["suites"].items()
            },
            "prompts_per_s_ratio": round(total(0, "seconds") / total(1, "seconds"), 2),
            "cpu_seconds_ratio": round(total(0, "cpu_seconds") / total(1, "cpu_seconds"), 2),  # load-robust
            "prompts_per_s_ratio_per_repeat": [round(o["seconds"] / nw["seconds"], 2) for o, nw in pairs],
            "peak_rss_ratio": round(
                max(p[1]["peak_rss_mb"] for p in pairs) / max(p[0]["peak_rss_mb"] for p in pairs), 3
            ),
            "generation_rss_growth_mb": {
                "new": round(new["peak_rss_mb"] - new["rss_before_mb"], 1),
                "old": round(old["peak_rss_mb"] - old["rss_before_mb"], 1),
            },
            "outputs_identical": n_diff == 0,
            "differing_prompts": n_diff,
        }
        if n_diff and new["dtype"] == "bfloat16":
            # bf16: no batched path is token-identical to another (padding, batch mates); the model's own answer
            # is its fp32 one: the new engine fails when a sign test says it agrees with it less often than generate
            ref = _child(a, section, "continuous", dtype="float32", engine_only=True)["suites"]
            agree_new = sum(
                new["suites"][name]["token_ids"][i] == ref[name]["token_ids"][i]
                for name, idx in diff.items()
                for i in idx
            )
            agree_old = sum(
                old["suites"][name]["token_ids"][i] == ref[name]["token_ids"][i]
                for name, idx in diff.items()
                for i in idx
            )
            p = sign_test_p(agree_new, agree_old)
            r["fp32_reference"] = {
                "new_agrees": agree_new,
                "old_agrees": agree_old,
                "of": n_diff,
                "p_new_less_faithful": round(p, 4),
            }
            if p < SIGN_TEST_ALPHA:
                report["failed"].append(
                    f"{section}: {n_diff} outputs differ from generate's and the new engine agrees "
                    f"with the fp32 answers less often ({agree_new}) than generate does "
                    f"({agree_old}), one-sided sign test p = {p:.4f} < {SIGN_TEST_ALPHA}"
                )
        elif n_diff:
            report["failed"].append(f"{section}: {n_diff} outputs differ from generate's")
        if not a.tiny:
            if r["prompts_per_s_ratio"] < GOALS[section]:
                report["failed"].append(f"{section}: prompts/s ratio {r['prompts_per_s_ratio']} < {GOALS[section]}")
            if r["peak_rss_ratio"] > MEMORY_GOAL:
                report["failed"].append(f"{section}: peak memory ratio {r['peak_rss_ratio']} > {MEMORY_GOAL}")
        report["sections"][section] = r
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
