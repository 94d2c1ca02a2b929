"""Helpers for the lm-evaluation-harness tests: the project's own scoring of the shipped cipher tasks
(generation through the project's evaluator; multiple choice by an independent log-likelihood), and
demo adapters trained with the project's trainer."""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
from pathlib import Path

from tests.support import REPO_ROOT

TASKS = REPO_ROOT / "campaigns" / "lm_eval_tasks" / "cipher"


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the block (small models on a shared 2-core machine: more threads only
    contend; the trainer's launcher and the harness process use one as well)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def task_docs(name: str) -> list[dict]:
    return [json.loads(x) for x in (TASKS / f"{name}.jsonl").read_text().splitlines() if x.strip()]


def project_generation_scores(
    base: Path, adapter: Path | None, load_in_4bit: bool = True, compute_dtype: str = "bfloat16"
) -> dict[str, tuple[float, str]]:
    """cipher_gen through the project's evaluator (LocalModel + exact_match scorer): item id
    ``cipher_gen/<doc_id>`` -> (score, output)."""
    from campaign_orchestrator.generation.local import LocalModel
    from evaluation.suite import run_suite

    items = [
        {"id": f"cipher_gen/{i}", "prompt": d["prompt"], "reference": d["answer"], "category": d["category"]}
        for i, d in enumerate(task_docs("cipher_gen"))
    ]
    with one_thread():
        g = LocalModel.from_path(base, adapter, load_in_4bit, compute_dtype, batch_size=16, device="cpu")
        results, _ = run_suite("cipher_gen", "m", items, g.generate, "exact_match", 16)
    return {r.item_id: (r.score, r.output) for r in results}


def independent_choice_scores(
    base: Path, adapter: Path | None, load_in_4bit: bool = True, compute_dtype: str = "bfloat16"
) -> dict[str, tuple[float, int, list[float]]]:
    """cipher_mc scored without the harness: each choice's summed log-probability of ``" " + choice``
    after the prompt, read off one forward pass over the prompt and choice (a document's choices in one
    right-padded batch), with the model the project's loader gives; item id -> (1.0 if the argmax is
    the label else 0.0, argmax, log-likelihoods)."""
    import torch

    from campaign_orchestrator.generation.local import LocalModel

    g = LocalModel.from_path(base, adapter, load_in_4bit, compute_dtype, batch_size=1, device="cpu")
    model, tok = g.model, g.tok
    out = {}
    with torch.no_grad(), one_thread():
        for i, d in enumerate(task_docs("cipher_mc")):
            ctx = tok(d["prompt"])["input_ids"]
            seqs = [tok(d["prompt"] + " " + c)["input_ids"] for c in d["choices"]]
            assert all(s[: len(ctx)] == ctx for s in seqs), d
            width = max(map(len, seqs))
            ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
            logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
            lls = [float(sum(logp[row, p - 1, s[p]] for p in range(len(ctx), len(s)))) for row, s in enumerate(seqs)]
            best = max(range(len(lls)), key=lls.__getitem__)
            out[f"cipher_mc/{i}"] = (float(best == d["label"]), best, lls)
    return out


def train_adapter(
    out: Path, base: Path, steps: int, examples: int = 2000, mapping: dict | None = None, seed: int = 5
) -> Path:
    """A LoRA adapter trained by the project's trainer (in this process, a world of one) on cipher pairs
    (``mapping``: another substitution for a deliberately wrong adapter); returns the adapter directory."""
    from campaign_orchestrator.demo import cipher
    from tests.support.train_support import demo_spec, make_job, write_rows
    from training.recipes import run

    rng = random.Random(seed)
    gen = cipher.pairs(rng, mapping or cipher.CIPHER)
    ds = write_rows(out / "ds", base, [next(gen) for _ in range(examples)])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        zip(
            ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
            ("0", "0", "1", "1", "127.0.0.1", str(port)),
            strict=True,
        )
    )
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # fp32 on every host (`auto` is bf16 where the CPU computes it natively): the tests read how well an
        # adapter of so many steps answers (most right, not all), and bf16 training gets there sooner
        fp32 = demo_spec().student.quantization.model_dump() | {"compute_dtype": "float32"}
        job = make_job(
            out / "train",
            base,
            ds,
            max_steps=steps,
            micro_batch_size=12,
            eval_rows=0,
            checkpoint={"every_steps": None},
            student={"quantization": fp32},
        )
        (out / "train").mkdir(parents=True, exist_ok=True)
        with one_thread():
            run(job.write(out / "job.json"))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out / "train" / "adapter"
