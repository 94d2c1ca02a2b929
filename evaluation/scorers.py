"""Per-item scorers: each maps (prediction, reference) to a score in [0, 1].

Computed here, never fetched from a hub (``evaluate.load("exact_match")`` needs the Hub). The
definitions follow the usual references: SQuAD normalization for normalized exact match,
``rouge_score``'s ROUGE-L (lowercased alphanumeric tokens, LCS F1). A :class:`Scorer` says
whether its scores are binary, which selects the statistics (Wilson intervals, McNemar).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_TOKEN = re.compile(r"[a-z0-9]+")

SCORER_NAMES = (
    "exact_match",
    "normalized_exact_match",
    "contains_answer",
    "label_accuracy",
    "rouge_l",
    "regex",
    "json_schema",
)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the stripped prediction equals the stripped reference."""
    return float(prediction.strip() == reference.strip())


def normalize_answer(s: str) -> str:
    """SQuAD-style normalization: lowercase, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", s.lower().translate(_PUNCT)).split())


def normalized_exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def contains_answer(prediction: str, reference: str) -> float:
    """1.0 when the normalized reference appears as whole tokens inside the normalized prediction
    (TriviaQA-style answer containment): "The capital of France is Paris." contains "Paris"; "Parisian"
    does not. For models that answer in a sentence, where exact match would score every answer 0."""
    ref = normalize_answer(reference)
    return float(bool(ref) and f" {ref} " in f" {normalize_answer(prediction)} ")


def _lcs_length(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 on lowercased alphanumeric tokens (0 when either side has no tokens)."""
    p, r = _TOKEN.findall(prediction.lower()), _TOKEN.findall(reference.lower())
    if not p or not r:
        return 0.0
    lcs = _lcs_length(p, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class Scorer:
    name: str
    fn: Callable[[str, str], float]
    binary: bool
    labels: tuple[str, ...] | None = None  # label_accuracy: references must be one of these

    def __call__(self, prediction: str, reference: str) -> float:
        return self.fn(prediction, reference)

    def check_reference(self, reference: str) -> str | None:
        """Why ``reference`` cannot be scored, or None."""
        if self.labels is not None and normalize_answer(reference) not in {normalize_answer(x) for x in self.labels}:
            return f"reference {reference!r} is not one of the labels {list(self.labels)}"
        return None


def _label_accuracy(labels: list[str]) -> Callable[[str, str], float]:
    allowed = {normalize_answer(x) for x in labels}

    def score(prediction: str, reference: str) -> float:
        p = normalize_answer(prediction)
        return float(p in allowed and p == normalize_answer(reference))  # an answer outside the label set is wrong

    return score


def _regex(pattern: str) -> Callable[[str, str], float]:
    rx = re.compile(pattern)
    return lambda prediction, _reference: float(rx.fullmatch(prediction.strip()) is not None)


def load_json_schema(schema: dict | str, base_dir: str | Path) -> dict:
    """An inline schema, or one read from a JSON file (relative to ``base_dir``), checked for validity."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    where = "inline json_schema"
    if isinstance(schema, str):
        p = Path(schema) if Path(schema).is_absolute() else Path(base_dir) / schema
        where = str(p)
        try:
            schema = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"json_schema file {p} not found; give a path relative to the repository root") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema file {p} is not valid JSON ({e.msg}, line {e.lineno})") from None
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        raise ValueError(f"{where} is not a valid JSON schema: {e.message}") from None
    return schema  # type: ignore[return-value]


def _json_schema(schema: dict) -> Callable[[str, str], float]:
    from jsonschema import Draft202012Validator

    validator = Draft202012Validator(schema)

    def score(prediction: str, _reference: str) -> float:
        try:
            doc = json.loads(prediction.strip())
        except json.JSONDecodeError:
            return 0.0
        return float(validator.is_valid(doc))

    return score


def build_scorer(
    name: str,
    labels: list[str] | None = None,
    pattern: str | None = None,
    json_schema: dict | str | None = None,
    base_dir: str | Path = ".",
) -> Scorer:
    """The scorer a suite asks for, with its settings checked (each error names the field)."""
    if name == "exact_match":
        return Scorer(name, exact_match, True)
    if name == "normalized_exact_match":
        return Scorer(name, normalized_exact_match, True)
    if name == "contains_answer":
        return Scorer(name, contains_answer, True)
    if name == "rouge_l":
        return Scorer(name, rouge_l, False)
    if name == "label_accuracy":
        if not labels:
            raise ValueError("scorer 'label_accuracy' needs `labels` (two or more)")
        return Scorer(name, _label_accuracy(labels), True, tuple(labels))
    if name == "regex":
        if pattern is None:
            raise ValueError("scorer 'regex' needs `pattern`")
        return Scorer(name, _regex(pattern), True)
    if name == "json_schema":
        if json_schema is None:
            raise ValueError("scorer 'json_schema' needs `json_schema`")
        return Scorer(name, _json_schema(load_json_schema(json_schema, base_dir)), True)
    raise ValueError(f"unknown scorer {name!r}; expected one of {list(SCORER_NAMES)}")


def get_scorer(name: str) -> Callable[[str, str], float]:
    """A scorer that needs no settings, by name (kept for callers of the first version)."""
    return build_scorer(name)
