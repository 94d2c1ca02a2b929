"""Comments and docstrings of the library packages state rules and point to where a measurement lives
(docs/results.md); they carry no dated figures and no before/after figure stories, which go stale unseen."""

from __future__ import annotations

import ast
import io
import re
import tokenize

from tests.support import REPO_ROOT

PACKAGES = ("campaigns", "assets", "resources", "training", "evaluation", "campaign_orchestrator", "campaign_app")
# files another change is rewriting; each must still have a finding (remove it here once it has none)
PENDING: set[str] = set()

_UNIT = r"(%|×|x\b|s\b|ms\b|min\b|h\b|GiB|MiB|KiB|GB|MB|tokens/s|tok/s|prompts/s|GFLOP/s|TFLOP/s)"
PATTERNS = {
    "a date": re.compile(
        r"\b20\d\d-\d\d-\d\d\b|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* 20\d\d\b"
        r"|\bstop \d+\b"
    ),
    "a figure against a figure": re.compile(
        r"\d[\d,]*(\.\d+)?\s*" + _UNIT + r"?\s+(against|vs\.?|versus|instead of|"
        r"down from|up from|→|->)\s+~?\d",
        re.I,
    ),
    "a speed-up story": re.compile(
        r"\d+(\.\d+)?\s*[x×]\s+(longer|faster|slower|shorter|more|less|smaller|larger|"
        r"bigger|fewer)\b",
        re.I,
    ),
    "a measured figure": re.compile(r"\bmeasured\b[^.;]{0,60}?\d[\d,]*(\.\d+)?\s*" + _UNIT, re.I),
    "a before/after story": re.compile(r"\b(before|after) (this|the) (change|fix|work|patch)\b", re.I),
}
# data-format examples (a price's as_of date, a catalog version) are not measurements
EXAMPLE = re.compile(r"as_of|version")


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every docstring line of a Python source."""
    out = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def findings(source: str) -> list[str]:
    return [
        f"{line}: {what}: {text.strip()[:120]}"
        for line, text in prose(source)
        if not EXAMPLE.search(text)
        for what, rx in PATTERNS.items()
        if rx.search(text)
    ]


def test_library_comments_carry_no_dated_figures_or_stories():
    found = {}
    for pkg in PACKAGES:
        for f in sorted((REPO_ROOT / pkg).rglob("*.py")):
            if hits := findings(f.read_text()):
                found[f.relative_to(REPO_ROOT).as_posix()] = hits
    stale = sorted(PENDING - found.keys())
    assert not stale, f"{stale} no longer carry figures: remove them from PENDING"
    offenders = {f: h for f, h in found.items() if f not in PENDING}
    assert not offenders, "state the rule and point to docs/results.md, where the figures go: " + "; ".join(
        f"{f}:{h}" for f, hs in offenders.items() for h in hs
    )


def test_the_patterns_see_the_stories_they_are_for():
    src = (
        '"""Doc.\n\nMeasured on SmolLM2-135M: peak RSS 2,140 MB with glibc against 1,813 MB with jemalloc."""\n'
        "x = 1  # adapter took 27.8 s instead of 5.7 s (measured 2026-12-03)\n"
        "y = 2  # ~10x faster through aiohttp; see Dec 2026 notes, stop 32\n"
        "z = 3  # one thread: a floor for the n-thread figure (docs/results.md)\n"
        'c = """version: "2026-11-29"  as_of: "2026-01-15" """\n'
    )
    hits = findings(src)
    assert {h.split(": ")[1] for h in hits} == set(PATTERNS) - {"a before/after story"}
    assert not [h for h in hits if h.startswith(("6:", "7:"))]  # a rule with a pointer, and a data example
    assert findings("# 405 s before this work, 227 s after\n")
