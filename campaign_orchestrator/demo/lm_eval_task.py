"""The demo's lm-evaluation-harness tasks: the cipher as a generation task and as a multiple-choice
(log-likelihood) task, with local data written by this module (no hub).

``python -m campaign_orchestrator.demo.lm_eval_task DIR`` writes the task directory an ``lm_eval``
suite points its ``include_path`` at; the copy shipped in ``campaigns/lm_eval_tasks/cipher`` is this
module's output (a test checks it is unchanged). Data file paths in the YAML files are relative to the
task directory (the harness runs there). Pure Python, no dependencies.

- ``cipher_gen`` (``generate_until``): ``encode <word> =`` -> the encoded word, exact match after
  stripping the leading space the model answers with (``remove_whitespace`` before ``take_first``).
- ``cipher_mc`` (``multiple_choice``): the same prompt with four continuations: the encoding, the
  word copied (what the untrained student base does), another word's encoding of the same length,
  and the encoding with one letter changed; ``acc`` is the argmax of the summed log-likelihood.
- ``cipher`` is a group of the two: its subtasks are the suite's categories.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from campaign_orchestrator.demo import cipher

GEN_SEED, MC_SEED = 2024, 2025
ITEMS = 60

COMMON = """\
# Shared settings of the cipher tasks (no `task:` key: used only through `include:`).
dataset_path: json
test_split: test
doc_to_text: "{{prompt}}"
target_delimiter: " "
metadata:
  version: 1.0
"""

GEN = """\
include: _cipher_common.yaml
task: cipher_gen
dataset_kwargs:
  data_files:
    test: cipher_gen.jsonl        # relative to this directory (the harness runs in it)
output_type: generate_until
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
filter_list:
  - name: strip                   # the model answers " nvv": strip it, then take the one answer
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

MC = """\
include: _cipher_common.yaml
task: cipher_mc
dataset_kwargs:
  data_files:
    test: cipher_mc.jsonl
output_type: multiple_choice
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GROUP = """\
group: cipher
task:
  - cipher_gen
  - cipher_mc
metadata:
  version: 1.0
"""


def gen_docs(n: int = ITEMS, seed: int = GEN_SEED) -> list[dict]:
    return [
        {"id": f"g{i:03d}", "prompt": it["prompt"], "answer": it["reference"], "category": it["category"]}
        for i, it in enumerate(cipher.items(n, seed))
    ]


def _other_word(rng: random.Random, length: int, avoid: str) -> str:
    while True:
        w = "".join(rng.choice(cipher.LETTERS) for _ in range(length))
        if w != avoid:
            return w


def mc_docs(n: int = ITEMS, seed: int = MC_SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i, it in enumerate(cipher.items(n, seed)):
        word = it["prompt"].removeprefix("encode ").removesuffix(" =")
        right = it["reference"]
        pos = rng.randrange(len(right))
        typo = right[:pos] + rng.choice([c for c in cipher.LETTERS if c != right[pos]]) + right[pos + 1 :]
        wrong = {word, cipher.encode(_other_word(rng, len(word), word)), typo} - {right}
        while len(wrong) < 3:  # the copy may coincide with another choice; top up with another encoding
            wrong.add(cipher.encode(_other_word(rng, len(word), word)))
            wrong.discard(right)
        choices = [right, *sorted(wrong)]
        rng.shuffle(choices)
        out.append(
            {
                "id": f"m{i:03d}",
                "prompt": it["prompt"],
                "choices": choices,
                "label": choices.index(right),
                "category": it["category"],
            }
        )
    return out


def files() -> dict[str, str]:
    """File name -> content of the task directory."""
    return {
        "_cipher_common.yaml": COMMON,
        "cipher_gen.yaml": GEN,
        "cipher_mc.yaml": MC,
        "cipher.yaml": GROUP,
        "cipher_gen.jsonl": "".join(json.dumps(d) + "\n" for d in gen_docs()),
        "cipher_mc.jsonl": "".join(json.dumps(d) + "\n" for d in mc_docs()),
    }


def write_task(directory: str | Path) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files().items():
        (d / name).write_text(text, encoding="utf-8")
    return d


if __name__ == "__main__":
    print(write_task(sys.argv[1] if len(sys.argv) > 1 else "campaigns/lm_eval_tasks/cipher"))
