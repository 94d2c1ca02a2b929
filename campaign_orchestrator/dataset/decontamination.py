"""N-gram decontamination of training data against evaluation documents. Pure Python.

Text is lowercased and split into word tokens (``\\w+``, punctuation and spacing dropped, as the
harness's own decontamination janitor does). A suite document contributes every n-gram of its
tokens; a document shorter than ``n`` tokens contributes its whole token sequence (so a short
question is still found verbatim inside a longer training prompt); a document shorter than
``min_doc_tokens`` is not checked (counted as ``too_short``). A training text is contaminated by a
suite when it contains any of the suite's n-grams (or whole short documents) as a contiguous run
of tokens.

The usual setting is n = 13 (GPT-3's and the harness's choice for benchmark overlap).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

_WORD = re.compile(r"\w+")


def tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@dataclass
class SuiteDocs:
    """One suite's documents as (document id, text)."""

    suite: str
    docs: list[tuple[str, str]]


@dataclass
class NgramIndex:
    n: int
    min_doc_tokens: int = 2
    grams: dict[tuple[str, ...], set[tuple[str, str]]] = field(default_factory=lambda: defaultdict(set))
    lengths: set[int] = field(default_factory=set)
    checked: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    too_short: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, suite: str, doc_id: str, text: str) -> None:
        t = tokens(text)
        if len(t) < self.min_doc_tokens:
            self.too_short[suite] += 1
            return
        self.checked[suite] += 1
        size = min(self.n, len(t))
        self.lengths.add(size)
        for i in range(len(t) - size + 1):
            self.grams[tuple(t[i : i + size])].add((suite, doc_id))

    def matches(self, text: str) -> set[tuple[str, str]]:
        """(suite, document id) of every suite document ``text`` overlaps."""
        t = tokens(text)
        hit: set[tuple[str, str]] = set()
        for size in self.lengths:
            for i in range(len(t) - size + 1):
                docs = self.grams.get(tuple(t[i : i + size]))
                if docs:
                    hit |= docs
        return hit


def build_index(suites: Iterable[SuiteDocs], n: int, min_doc_tokens: int = 2) -> NgramIndex:
    index = NgramIndex(n, min_doc_tokens)
    for s in suites:
        for doc_id, text in s.docs:
            index.add(s.suite, doc_id, text)
    return index


@dataclass
class Contamination:
    """Which training rows overlap which suites, with the counts a report shows."""

    rows: dict[int, set[tuple[str, str]]]  # row index -> (suite, document id)
    by_field: dict[str, int]  # "prompt" / "completion" -> rows matched through that field
    index: NgramIndex

    @property
    def contaminated(self) -> int:
        return len(self.rows)

    def summary(self, total_rows: int, examples: int = 10, ids: list[str] | None = None) -> dict:
        per_suite: dict[str, int] = defaultdict(int)
        docs_hit: dict[str, set[str]] = defaultdict(set)
        for hits in self.rows.values():
            for suite in {s for s, _ in hits}:
                per_suite[suite] += 1
            for s, d in hits:
                docs_hit[s].add(d)
        shown = sorted(self.rows)[:examples]
        suites = sorted(set(self.index.checked) | set(self.index.too_short))
        return {
            "ngram": self.index.n,
            "min_doc_tokens": self.index.min_doc_tokens,
            "training_rows": total_rows,
            "contaminated_rows": self.contaminated,
            "matched_by": dict(self.by_field),
            "suites": {
                s: {
                    "documents_checked": self.index.checked.get(s, 0),
                    "documents_too_short": self.index.too_short.get(s, 0),
                    "training_rows_overlapping": per_suite.get(s, 0),
                    "documents_overlapped": len(docs_hit.get(s, ())),
                }
                for s in suites
            },
            "examples": [
                {"row": ids[i] if ids else i, "overlaps": sorted(f"{s}:{d}" for s, d in self.rows[i])[:5]}
                for i in shown
            ],
        }


def find_contamination(
    rows: list[dict], index: NgramIndex, text_fields: tuple[str, ...] = ("prompt", "completion")
) -> Contamination:
    """Rows (dicts with ``text_fields``) that overlap any indexed suite document."""
    hits: dict[int, set[tuple[str, str]]] = {}
    by_field: dict[str, int] = {f: 0 for f in text_fields}
    for i, r in enumerate(rows):
        found: set[tuple[str, str]] = set()
        for f in text_fields:
            m = index.matches(str(r.get(f) or ""))
            if m:
                by_field[f] += 1
                found |= m
        if found:
            hits[i] = found
    return Contamination(hits, by_field, index)
