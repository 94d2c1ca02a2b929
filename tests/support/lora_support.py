"""A real LoRA adapter trained in this process (PEFT, fp32, a plain loop) on the demo student for the
cipher task, restricted to words over a given alphabet: an adapter that knows one distribution and not
another (words over other letters). Seconds on a CPU: the demo student has ~100k parameters."""

from __future__ import annotations

import random
from pathlib import Path

from campaign_orchestrator.demo import cipher


def words(n: int, letters: str, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """``n`` distinct words of 3-8 letters drawn from ``letters``."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        w = "".join(rng.choice(letters) for _ in range(rng.randint(cipher.MIN_LEN, cipher.MAX_LEN)))
        if w not in exclude and w not in out:
            out.append(w)
    return out


def items(ws: list[str], id_prefix: str) -> list[dict]:
    return [
        {
            "id": f"{id_prefix}{i:05d}",
            "prompt": cipher.prompt_for(w),
            "reference": cipher.encode(w),
            "category": cipher.category_of(w),
        }
        for i, w in enumerate(ws)
    ]


def train_cipher_adapter(
    student: Path, out: Path, train_words: list[str], steps: int = 400, batch: int = 32, lr: float = 5e-3, seed: int = 0
) -> Path:
    """LoRA (r 16, every projection) on ``student``, trained to answer ``encode <w> =`` with the cipher of
    ``w`` for the given words; saved to ``out`` like the trainer saves an adapter."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small is bound by per-op overhead: more threads only contend
    try:
        return _train(student, out, train_words, steps, batch, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _train(student, out, train_words, steps, batch, lr, seed) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(student))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32, attn_implementation="eager"),
        LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        seqs, labels = [], []
        for w in rng.sample(train_words, min(batch, len(train_words))):
            p = tok(cipher.prompt_for(w), add_special_tokens=False).input_ids
            c = tok(" " + cipher.encode(w), add_special_tokens=False).input_ids + [tok.eos_token_id]
            seqs.append([tok.bos_token_id] + p + c)
            labels.append([-100] * (1 + len(p)) + c)
        n = max(map(len, seqs))
        x = torch.full((len(seqs), n), tok.pad_token_id)
        y = torch.full((len(seqs), n), -100)
        m = torch.zeros((len(seqs), n), dtype=torch.long)
        for i, (s, lab) in enumerate(zip(seqs, labels, strict=True)):
            x[i, : len(s)], y[i, : len(lab)], m[i, : len(s)] = torch.tensor(s), torch.tensor(lab), 1
        loss = model(input_ids=x, attention_mask=m, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.save_pretrained(str(out))
    return out
