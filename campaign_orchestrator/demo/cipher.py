"""The synthetic task of the demo: encode a lowercase word with a fixed substitution cipher.

``encode hello =`` -> `` itssg``. Answers are checked exactly. The teacher is trained on this
cipher; the student base is trained on the same prompt format with the identity mapping (it
copies the word), so it knows the format but scores ~0 on the task until it is distilled.
Pure Python, no dependencies.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator
from pathlib import Path

LETTERS = string.ascii_lowercase
CIPHER_SEED = 7
MIN_LEN, MAX_LEN = 3, 8


def cipher_map(seed: int = CIPHER_SEED) -> dict[str, str]:
    perm = list(LETTERS)
    random.Random(seed).shuffle(perm)
    return dict(zip(LETTERS, perm, strict=True))


IDENTITY = {c: c for c in LETTERS}
CIPHER = cipher_map()


def prompt_for(word: str) -> str:
    return f"encode {word} ="


def encode(word: str, mapping: dict[str, str] = CIPHER) -> str:
    return "".join(mapping[c] for c in word)


def category_of(word: str) -> str:
    return "short" if len(word) <= 5 else "long"


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))


def pairs(rng: random.Random, mapping: dict[str, str]) -> Iterator[tuple[str, str]]:
    """Endless (prompt, completion) pairs; the completion starts with a space."""
    while True:
        w = random_word(rng)
        yield prompt_for(w), " " + encode(w, mapping)


def items(n: int, seed: int, id_prefix: str = "p") -> list[dict]:
    """``n`` distinct prompt items with exact references and a length category."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out = []
    while len(out) < n:
        w = random_word(rng)
        if w in seen:
            continue
        seen.add(w)
        out.append(
            {
                "id": f"{id_prefix}{len(out):06d}",
                "prompt": prompt_for(w),
                "reference": encode(w),
                "category": category_of(w),
            }
        )
    return out


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return p
