"""Per-item scorers: each maps (prediction, reference) to a score in [0, 1]. Pure Python."""

from __future__ import annotations

import re
import string
from collections.abc import Callable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the stripped prediction equals the stripped reference."""
    return float(prediction.strip() == reference.strip())


def normalize_answer(s: str) -> str:
    """SQuAD-style normalization: lowercase, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", s.lower().translate(_PUNCT)).split())


def normalized_exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


SCORERS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "normalized_exact_match": normalized_exact_match,
}


def get_scorer(name: str) -> Callable[[str, str], float]:
    try:
        return SCORERS[name]
    except KeyError:
        raise ValueError(f"unknown scorer {name!r}; expected one of {sorted(SCORERS)}") from None
