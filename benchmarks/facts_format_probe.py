"""How much of the facts task's loss is the answer's spelling (issue 46): the same LoRA fine-tune of
SmolLM2-135M-Instruct on the facts cities' one-word countries, with the target spelled three ways, scored on the
held-out cities.

The facts campaigns (``benchmarks/facts_recipes.py``) teach one *lowercase* word. SmolLM2's tokenizer has no whole-word
token for most lowercase country names ("germany" is ``g erm any``, "argentina" ``arg ent ina``), while the capitalized
names it saw in text are one or few tokens ("Germany", "Australia"). This probe isolates that: no teacher, no replay, no
campaign: the references of ``campaigns/data/smollm2/facts-train.jsonl`` as targets (a perfect teacher), spelled as the
reference (``reference``), lowercased (``lower``: "argentina"), title-cased (``title``: "Argentina") or after a space
(``space``: " argentina", which strips to the reference). The JSON of 2026-12-05 was measured when the references were
lowercase (``reference`` = ``lower`` then); since the data moved to the base's spelling, ``reference`` = ``title``;
the same model, LoRA (r 8, alpha 16, every linear layer, as ``smollm2_facts.yaml``),
optimizer, schedule and seed. It reports, per spelling, the exact match (stripped, against the reference in the
target's spelling) on the 109 held-out cities of ``facts-suite.jsonl`` and on the ones whose country the base's own
greedy 32-token answer names (``contains_answer``, as the diagnosis scores "knew it").

Usage (each call adds or replaces its spellings' entries in ``--out``):
  python benchmarks/facts_format_probe.py --targets reference title --out benchmarks/data/facts_format_probe_<date>.json
  python benchmarks/facts_format_probe.py --tiny --out /tmp/p.json        # 8 cities, 1 epoch: the suite's check
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
DATA = REPO / "campaigns" / "data" / "smollm2"
SPELLINGS = {
    "reference": lambda r: r,
    "lower": lambda r: r.lower(),
    "title": lambda r: r.title(),
    "space": lambda r: " " + r,
}
MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rows(name: str, n: int | None) -> list[dict]:
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    return rows[:: max(1, len(rows) // n)][:n] if n else rows


class Probe:
    def __init__(self, model_dir: Path, dtype: str):
        import torch
        from transformers import AutoTokenizer

        self.torch, self.model_dir = torch, model_dir
        self.dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.tok = AutoTokenizer.from_pretrained(model_dir)

    def load(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)

    def chat(self, prompt: str) -> str:
        msgs = [{"role": "user", "content": prompt}]
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def generate(self, model, prompts: list[str], max_new_tokens: int, batch: int = 16) -> list[str]:
        tok, out = self.tok, []
        tok.padding_side = "left"
        with self.torch.no_grad():
            for i in range(0, len(prompts), batch):
                enc = tok(
                    [self.chat(p) for p in prompts[i : i + batch]],
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                )
                g = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
                out += tok.batch_decode(g[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        return out

    def train(self, rows: list[dict], spell, a) -> tuple[object, dict]:
        """LoRA on ``rows`` (loss on the target and EOS only), AdamW, 3 warm-up steps then linear decay."""
        from peft import LoraConfig, get_peft_model

        torch, tok = self.torch, self.tok
        random.seed(a.seed)
        torch.manual_seed(a.seed)
        model = get_peft_model(
            self.load(), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=MLP, task_type="CAUSAL_LM")
        )
        pairs = []
        for r in rows:
            p = tok(self.chat(r["prompt"]), add_special_tokens=False)["input_ids"]
            t = tok(spell(r["reference"]) + tok.eos_token, add_special_tokens=False)["input_ids"]
            pairs.append((p + t, [-100] * len(p) + t))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)
        steps = a.epochs * -(-len(pairs) // a.batch)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3) * max(0.0, 1 - i / steps))
        model.train()
        t0, losses = time.perf_counter(), []
        for _ in range(a.epochs):
            random.shuffle(pairs)
            for i in range(0, len(pairs), a.batch):
                b = pairs[i : i + a.batch]
                width = max(len(x) for x, _ in b)
                ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in b])
                labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in b])
                mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in b])
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad()
                losses.append(round(loss.item(), 4))
        model.eval()
        return model, {"steps": steps, "train_s": round(time.perf_counter() - t0, 1), "last_losses": losses[-3:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=list(SPELLINGS), choices=list(SPELLINGS))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: compute_dtype auto")
    ap.add_argument("--tiny", action="store_true", help="8 training and 8 held-out cities, 1 epoch")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)

    import torch

    from benchmarks._real_model import model_dir
    from benchmarks.record_run import host
    from evaluation.scorers import contains_answer, exact_match

    torch.set_num_threads(min(2, torch.get_num_threads()))
    info = host()
    dtype = a.dtype or info["auto_dtype"]
    if a.tiny:
        a.epochs = 1
    train, suite = _rows("facts-train", 8 if a.tiny else None), _rows("facts-suite", 8 if a.tiny else None)
    probe = Probe(model_dir(), dtype)
    base = probe.generate(probe.load(), [r["prompt"] for r in suite], 32)
    knew = [bool(contains_answer(b, r["reference"])) for b, r in zip(base, suite, strict=True)]
    report = json.loads(a.out.read_text()) if a.out.exists() else {"variants": {}}
    report.update(
        date=dt.date.today().isoformat(),
        host=info,
        dtype=dtype,
        settings={k: getattr(a, k) for k in ("epochs", "lr", "batch", "seed", "tiny")},
        items=len(suite),
        train_items=len(train),
        base_knew=sum(knew),
    )
    for name in a.targets:
        spell = SPELLINGS[name]
        model, fit = probe.train(train, spell, a)
        answers = probe.generate(model, [r["prompt"] for r in suite], 6)
        right = [bool(exact_match(x, spell(r["reference"]))) for x, r in zip(answers, suite, strict=True)]
        on_knew = [ok for ok, k in zip(right, knew, strict=True) if k]
        report["variants"][name] = {
            "target_example": spell(suite[0]["reference"]),
            "target_tokens": probe.tok.tokenize(spell(suite[0]["reference"])),
            "exact_match": round(sum(right) / len(right), 4),
            "right": sum(right),
            "on_base_knew": round(sum(on_knew) / len(on_knew), 4) if on_knew else None,
            "right_on_base_knew": sum(on_knew),
            **fit,
            "examples": [[r["prompt"], x] for r, x in list(zip(suite, answers, strict=True))[:4]],
        }
        print(json.dumps({name: report["variants"][name]}), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
