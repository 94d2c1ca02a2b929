"""Build the demo's tokenizer, teacher and student base from a seed, and save them like checkpoints.

Run ``python -m campaign_orchestrator.demo --artifacts DIR``. The result is cached under
``DIR/models/demo-<recipe hash>/`` with a ``_SUCCESS`` marker; a second call is a no-op. The
models are real ``LlamaForCausalLM`` checkpoints loaded back with ``from_pretrained(path)``.
The MoE student (``Qwen3MoeForCausalLM``, :data:`campaign_orchestrator.demo.recipe.MOE_RECIPE`) is
built the same way under ``DIR/models/demo-moe-<its hash>/`` (:func:`build_moe_student`), and the teacher with
a byte-level BPE tokenizer (:data:`campaign_orchestrator.demo.recipe.XTOK_RECIPE`) under
``DIR/models/demo-xtok-<its hash>/`` (:func:`build_xtok_teacher`).
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

from campaign_orchestrator.demo import cipher
from campaign_orchestrator.demo.recipe import (
    MOE_RECIPE,
    RECIPE,
    XTOK_RECIPE,
    models_dir,
    moe_models_dir,
    moe_recipe_hash,
    recipe_hash,
    xtok_models_dir,
    xtok_recipe_hash,
)

Log = Callable[[str], None]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level BPE tokenizer trained on the task's text with ``tokenizers``."""
    spec = RECIPE["tokenizer"]
    rng = random.Random(spec["seed"])
    corpus = []
    for mapping in (cipher.CIPHER, cipher.IDENTITY):
        gen = cipher.pairs(rng, mapping)
        corpus += [p + c for p, c in (next(gen) for _ in range(spec["corpus_items"] // 2))]
    corpus.append(cipher.LETTERS + " =")  # every character the task can produce
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=64, special_tokens=spec["special_tokens"]))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.add_bos_token = True
    return hf


def build_xtok_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2's byte alphabet, so any text encodes) trained on the task's text with
    ``tokenizers``: the second demo teacher's (:data:`XTOK_RECIPE`). Its merges join an answer's leading space to
    its first letter and frequent letter pairs, so its tokens straddle the demo student's characters."""
    spec = XTOK_RECIPE["tokenizer"]
    rng = random.Random(spec["seed"])
    corpus = []
    for mapping in (cipher.CIPHER, cipher.IDENTITY):
        gen = cipher.pairs(rng, mapping)
        corpus += [p + c for p, c in (next(gen) for _ in range(spec["corpus_items"] // 2))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=spec["vocab_size"],
            special_tokens=spec["special_tokens"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.add_bos_token = True
    return hf


def _batch(tok: PreTrainedTokenizerFast, gen, bs: int) -> dict[str, torch.Tensor]:
    seqs, labels = [], []
    for _ in range(bs):
        p, c = next(gen)
        pi = tok(p, add_special_tokens=False).input_ids
        ci = tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append([tok.bos_token_id] + pi + ci)
        labels.append([-100] * (1 + len(pi)) + ci)
    n = max(map(len, seqs))
    x = torch.full((bs, n), tok.pad_token_id)
    y = torch.full((bs, n), -100)
    m = torch.zeros((bs, n), dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labels, strict=True)):
        x[i, : len(s)] = torch.tensor(s)
        y[i, : len(lab)] = torch.tensor(lab)
        m[i, : len(s)] = 1
    return {"input_ids": x, "labels": y, "attention_mask": m}


def _train(tok: PreTrainedTokenizerFast, spec: dict, log: Log, recipe: dict = RECIPE) -> LlamaForCausalLM:
    torch.manual_seed(spec["seed"])
    cfg = LlamaConfig(
        vocab_size=len(tok),
        num_key_value_heads=spec["config"]["num_attention_heads"],
        max_position_embeddings=recipe["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **spec["config"],
    )
    return _fit(LlamaForCausalLM(cfg), tok, spec, log)


def moe_config(tok: PreTrainedTokenizerFast | None = None, vocab_size: int | None = None) -> Qwen3MoeConfig:
    """The MoE student's config (:data:`MOE_RECIPE`); ``tok`` gives the vocabulary and special ids."""
    spec = MOE_RECIPE["moe_student"]
    ids = (
        {}
        if tok is None
        else {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    )
    return Qwen3MoeConfig(
        vocab_size=len(tok) if tok is not None else vocab_size,
        max_position_embeddings=MOE_RECIPE["max_position_embeddings"],
        tie_word_embeddings=True,
        **ids,
        **spec["config"],
    )


def _train_moe(tok: PreTrainedTokenizerFast, log: Log) -> Qwen3MoeForCausalLM:
    spec = MOE_RECIPE["moe_student"]
    torch.manual_seed(spec["seed"])
    # The router's load-balancing loss is part of Hugging Face's loss when router logits are asked for
    # (coefficient router_aux_loss_coef), so the experts start balanced.
    return _fit(Qwen3MoeForCausalLM(moe_config(tok)), tok, spec, log, output_router_logits=True)


def _fit(model, tok: PreTrainedTokenizerFast, spec: dict, log: Log, **forward):
    mapping = cipher.CIPHER if spec["mapping"] == "cipher" else cipher.IDENTITY
    gen = cipher.pairs(random.Random(spec["seed"] + 1000), mapping)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec["lr"], total_steps=spec["steps"], pct_start=0.1)
    model.train()
    for step in range(spec["steps"]):
        loss = model(**_batch(tok, gen, spec["batch_size"]), **forward).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == spec["steps"] - 1:
            log(f"  step {step:4d}/{spec['steps']} loss {loss.item():.4f}")
    model.eval()
    return model


@torch.no_grad()
def exact_match_on_task(
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    n: int,
    seed: int = 12345,
    mapping: dict[str, str] = cipher.CIPHER,
) -> float:
    """Greedy exact match on ``n`` fresh cipher items (``mapping``: the answers checked; the identity
    mapping checks the copy task the student bases learned)."""
    items = cipher.items(n, seed=seed, id_prefix="b")
    tok.padding_side = "left"
    enc = tok([it["prompt"] for it in items], return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=cipher.MAX_LEN + 3, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    refs = [cipher.encode(it["prompt"].split()[1], mapping) for it in items]
    return sum(t.strip() == ref for t, ref in zip(texts, refs, strict=True)) / n


def build_demo_models(
    artifact_root: str | Path, log: Log = print, force: bool = False, moe: bool = True, xtok: bool = False
) -> dict:
    """Build (or reuse) the demo models; returns the build report (``moe``: also the MoE student, whose
    report is under ``moe_student``; ``xtok``: also the byte-level BPE teacher, under ``teacher_bpe``)."""
    report = _build_dense(artifact_root, log, force)
    if moe:
        report["moe_student"] = build_moe_student(artifact_root, log, force)
    if xtok:
        report["teacher_bpe"] = build_xtok_teacher(artifact_root, log, force)
    return report


def build_xtok_teacher(artifact_root: str | Path, log: Log = print, force: bool = False) -> dict:
    """Build (or reuse) the cipher teacher with a byte-level BPE tokenizer ``@demo/teacher_bpe``; returns its
    build report (``build_seconds``: the wall time of the build that made it)."""
    final = xtok_models_dir(artifact_root)
    if (final / "_SUCCESS").exists() and not force:
        return json.loads((final / "build_report.json").read_text()) | {"cached": True}
    t0 = time.perf_counter()
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = build_xtok_tokenizer()
    spec = XTOK_RECIPE["teacher_bpe"]
    log(
        f"training demo teacher_bpe (byte-level BPE, {len(tok)} tokens, {spec['mapping']} mapping, "
        f"{spec['steps']} steps)"
    )
    model = _train(tok, spec, log, XTOK_RECIPE)
    report = {
        "recipe_hash": xtok_recipe_hash(),
        "vocab_size": len(tok),
        "exact_match": exact_match_on_task(model, tok, XTOK_RECIPE["eval_items"]),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    model.save_pretrained(tmp / "teacher_bpe")
    tok.save_pretrained(tmp / "teacher_bpe")
    report["train_seconds"] = report["build_seconds"] = round(time.perf_counter() - t0, 2)
    log(f"demo teacher_bpe: exact match on the cipher task {report['exact_match']:.3f}")
    (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    (tmp / "_SUCCESS").write_text("")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return report | {"cached": False}


def build_moe_student(artifact_root: str | Path, log: Log = print, force: bool = False) -> dict:
    """Build (or reuse) the MoE student ``@demo/moe_student``; returns its build report."""
    final = moe_models_dir(artifact_root)
    if (final / "_SUCCESS").exists() and not force:
        return json.loads((final / "build_report.json").read_text()) | {"cached": True}
    t0 = time.perf_counter()
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one thread than on two busy cores (thread sync)
    try:
        report = _build_moe(tmp, log)
    finally:
        torch.set_num_threads(threads)
    report["train_seconds"] = report["build_seconds"] = round(time.perf_counter() - t0, 2)
    log(
        f"demo moe_student: exact match on the cipher task {report['exact_match']:.3f}, on the copy task "
        f"{report['copy_exact_match']:.3f}"
    )
    (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    (tmp / "_SUCCESS").write_text("")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return report | {"cached": False}


def _build_moe(tmp: Path, log: Log) -> dict:
    tok = build_tokenizer()
    spec = MOE_RECIPE["moe_student"]
    log(
        f"training demo moe_student (Qwen3-MoE, {spec['config']['num_experts']} experts, top-"
        f"{spec['config']['num_experts_per_tok']}, {spec['mapping']} mapping, {spec['steps']} steps)"
    )
    model = _train_moe(tok, log)
    n = MOE_RECIPE["eval_items"]
    report = {
        "recipe_hash": moe_recipe_hash(),
        "vocab_size": len(tok),
        "exact_match": exact_match_on_task(model, tok, n),
        "copy_exact_match": exact_match_on_task(model, tok, n, mapping=cipher.IDENTITY),
        "parameters": sum(p.numel() for p in model.parameters()),
        "num_experts": model.config.num_experts,
        "num_experts_per_tok": model.config.num_experts_per_tok,
    }
    model.save_pretrained(tmp / "moe_student")
    tok.save_pretrained(tmp / "moe_student")
    return report


def _build_dense(artifact_root: str | Path, log: Log, force: bool) -> dict:
    final = models_dir(artifact_root)
    if (final / "_SUCCESS").exists() and not force:
        report = json.loads((final / "build_report.json").read_text())
        report["cached"] = True
        return report
    t0 = time.perf_counter()
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = build_tokenizer()
    report: dict = {"recipe_hash": recipe_hash(), "vocab_size": len(tok)}
    for name in ("teacher", "student"):
        t = time.perf_counter()
        log(f"training demo {name} ({RECIPE[name]['mapping']} mapping, {RECIPE[name]['steps']} steps)")
        model = _train(tok, RECIPE[name], log)
        score = exact_match_on_task(model, tok, RECIPE["eval_items"])
        model.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
        report[name] = {
            "exact_match": score,
            "parameters": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(time.perf_counter() - t, 2),
        }
        log(f"demo {name}: exact match on the cipher task {score:.3f}")
    report["build_seconds"] = round(time.perf_counter() - t0, 2)
    (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    (tmp / "_SUCCESS").write_text("")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    report["cached"] = False
    return report
