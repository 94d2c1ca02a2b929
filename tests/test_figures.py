"""Every measured figure in README.md and docs/results.md cites the JSON it comes from, and says what that JSON says.

The citation (docs/results.md explains it at the top): the figure is the text of a Markdown link to the JSON file,
the link's fragment is the key path inside it, dots between keys, a number for a list index:

    [22,661 tokens/s](../benchmarks/data/train_gpu_step_2026-12-04_h200.json#results.lora.tokens_per_s)

The printed number must equal the JSON value rounded to the printed decimals (``%`` and ``pts`` print a fraction
times 100; thousands separators, ``**``, ``$``, ``+`` and ``−`` are read as written). Outside citations, no number
with a unit (s, min, seconds, minutes, hours, ms, µs, tok/s, tokens/s, prompts/s, GB, MB, GiB, MiB, %, pts, ×,
x, $) may appear, and no
table cell may be a bare number, unless the line matches the short allowlist below (goals and prices, which are
settings, not measurements). A recorded transcript is a fenced block right after ``<!-- output: <json>#<key> -->``:
each of its lines (but ``...``) must be a line of the string (or list of strings) at that key. Fenced code blocks
otherwise, and HTML comments, are not prose and are skipped."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

PAGES = ("README.md", "docs/results.md")
DATA = REPO_ROOT / "benchmarks" / "data"

CITE = re.compile(r"\[(?P<text>[^\[\]]+)\]\((?P<path>[^()\s#]*benchmarks/data/[^()\s#]+\.json)#(?P<key>[^()\s]+)\)")
OUTPUT = re.compile(r"<!--\s*output:\s*(?P<path>\S*benchmarks/data/\S+\.json)#(?P<key>\S+)\s*-->")
NUMBER = re.compile(r"(?P<sign>[+\-−])?(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)")
UNIT = (
    r"(?:%|\s?pts\b|×(?!\s?\d)|x\b(?!\s?\d)|\s?(?:ms|µs|s|min|h|seconds?|minutes?|hours?)\b"
    r"|\s?(?:tok|tokens|prompts|items|GFLOP|TFLOP)/s"
    r"|\s?(?:GB|MB|KB|GiB|MiB|KiB|TB)\b)"
)
WITH_UNIT = re.compile(r"(?<![\w.#/-])(?:\$\s?\d[\d,]*(?:\.\d+)?|[+\-−]?\d[\d,]*(?:\.\d+)?" + UNIT + r")")
BARE_CELL = re.compile(r"^\s*(?:\*\*)?[+\-−]?\$?\d[\d,]*(?:\.\d+)?(?:\*\*)?\s*$")

# Lines that may carry an uncited number with a unit, each with why: settings and goals, not measurements.
ALLOWED = {
    r"\$[\d.]+/GPU-hour": "a price from the pricing catalog (campaigns/pricing/catalog.yaml), a setting",
    r"\b(?:goal|target)s? (?:of )?[≥≤]? ?\d[\d.]*×": "a benchmark's goal, written in the benchmark",
    r"\(\s*[≥≤] ?\d[\d.]*×\s*\)": "a goal beside the measured ratio, written in the benchmark",
    r"\b0\.5×–2×": "the dashboard's planner-miss band (MISS_LOW, MISS_HIGH in costs/dashboard.py)",
}


@dataclass
class Problem:
    page: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.what}"


def value_at(doc, key: str):
    """The value at a dotted key path (a number for a list index); KeyError naming the missing part."""
    v = doc
    for part in key.split("."):
        if isinstance(v, list) and part.lstrip("-").isdigit():
            v = v[int(part)]
        elif isinstance(v, dict) and part in v:
            v = v[part]
        else:
            raise KeyError(part)
    return v


def printed_number(text: str) -> tuple[float, int, float] | None:
    """(value, decimals, scale) of the one number in a figure's text; None when it holds no number or several."""
    plain = text.replace("**", "").replace("$", "")
    found = list(NUMBER.finditer(plain))
    if len(found) != 1:
        return None
    m = found[0]
    num = m.group("num").replace(",", "")
    value = float(num) * (-1 if m.group("sign") in ("-", "−") else 1)
    decimals = len(num.split(".")[1]) if "." in num else 0
    after = plain[m.end() :].strip()
    scale = 100.0 if after.startswith(("%", "pts", "points")) else 1.0
    return value, decimals, scale


def check_citation(text: str, path: Path, key: str) -> str | None:
    """What is wrong with one cited figure, or None."""
    if not path.is_file():
        return f"[{text}] cites {path.name}, which is not in benchmarks/data"
    try:
        v = value_at(json.loads(path.read_text()), key)
    except KeyError as e:
        return f"[{text}] cites {path.name}#{key}: no key {e.args[0]!r} there"
    parsed = printed_number(text)
    if parsed is None:
        return f"[{text}] should hold exactly one number (one figure per citation)"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return f"[{text}] cites {path.name}#{key}, which holds {v!r}, not a number"
    shown, decimals, scale = parsed
    if abs(v * scale - shown) > 0.5 * 10**-decimals + 1e-9:
        want = f"{v * scale:,.{decimals}f}"
        return f"[{text}] says {shown:g} but {path.name}#{key} is {v!r} ({want} at the printed precision)"
    return None


def _strip_comments(text: str) -> str:
    return re.sub(r"<!--(?!\s*output:).*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)


def problems_in(page: str, text: str, base: Path) -> list[Problem]:
    """Every problem of one page's figures (``base``: the directory its relative links start from)."""
    out: list[Problem] = []
    lines = _strip_comments(text).splitlines()
    i, fence, output = 0, None, None
    while i < len(lines):
        line, n = lines[i], i + 1
        if fence is not None:
            if line.strip().startswith(fence):
                fence, output = None, None
            elif output is not None and line.strip() not in ("...", ""):
                recorded, where = output
                if line.rstrip() not in recorded:
                    out.append(Problem(page, n, f"transcript line not in {where}: {line.strip()!r}"))
            i += 1
            continue
        m = OUTPUT.search(line)
        if m:
            path, key = (base / m["path"]).resolve(), m["key"]
            try:
                rec = value_at(json.loads(path.read_text()), key)
                rec = "\n".join(rec) if isinstance(rec, list) else str(rec)
                output = ({x.rstrip() for x in rec.splitlines()}, f"{path.name}#{key}")
            except (OSError, KeyError, ValueError) as e:
                out.append(Problem(page, n, f"transcript cites {m['path']}#{key}: {e!r}"))
                output = (set(), f"{m['path']}#{key}")
            if not (i + 1 < len(lines) and lines[i + 1].strip().startswith("```")):
                out.append(Problem(page, n, "an output citation must sit right above the fenced block it backs"))
            i += 1
            if i < len(lines) and lines[i].strip().startswith("```"):
                fence = lines[i].strip()[:3]
            i += 1
            continue
        if line.strip().startswith(("```", "~~~")):
            fence, output = line.strip()[:3], None
            i += 1
            continue
        for c in CITE.finditer(line):
            why = check_citation(c["text"], (base / c["path"]).resolve(), c["key"])
            if why:
                out.append(Problem(page, n, why))
        prose = CITE.sub("FIGURE", line)
        prose = re.sub(r"\]\([^)]*\)", "]", prose)  # link targets are not prose
        if any(re.search(p, prose) for p in ALLOWED):
            prose = re.sub("|".join(ALLOWED), "SETTING", prose)
        for u in WITH_UNIT.finditer(prose):
            out.append(Problem(page, n, f"uncited figure {u.group(0).strip()!r}: cite its JSON or remove it"))
        if prose.lstrip().startswith("|") and not re.fullmatch(r"\s*\|[\s|:-]+\|\s*", prose):
            for cell in prose.strip().strip("|").split("|")[1:]:  # the first cell names the row
                if BARE_CELL.match(cell):
                    out.append(Problem(page, n, f"uncited figure {cell.strip()!r} in a table: cite its JSON"))
        i += 1
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_measured_figure_cites_its_json_and_matches_it(page):
    path = REPO_ROOT / page
    found = problems_in(page, path.read_text(), path.parent)
    assert not found, "\n".join(map(str, found))


def test_each_page_cites_json_at_all():
    for page in PAGES:
        assert CITE.search((REPO_ROOT / page).read_text()), f"{page} cites no JSON: the checks above saw nothing"


# ------------------------------------------------------------------ the checker itself, on planted pages


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "benchmarks" / "data"
    d.mkdir(parents=True)
    (d / "run.json").write_text(
        json.dumps(
            {"wall_s": 32.4, "score": 0.825, "ratio": 4.28, "runs": [{"usd": 0.000554}], "out": "a line\n  b: 1.5 s"}
        )
    )
    return tmp_path


def _check(data: Path, md: str) -> list[str]:
    return [p.what for p in problems_in("page.md", md, data)]


def test_a_cited_figure_that_matches_passes_and_one_that_does_not_fails(data):
    ok = (
        "Took [32 s](benchmarks/data/run.json#wall_s), scored [**82.5%**](benchmarks/data/run.json#score), "
        "cost [$0.000554](benchmarks/data/run.json#runs.0.usd), [+82.5 pts](benchmarks/data/run.json#score)."
    )
    assert _check(data, ok) == []
    assert "says 33" in _check(data, "[33 s](benchmarks/data/run.json#wall_s)")[0]
    assert "says 82.4" in _check(data, "[82.4%](benchmarks/data/run.json#score)")[0]
    assert "no key 'wall'" in _check(data, "[32 s](benchmarks/data/run.json#wall)")[0]
    assert "not in benchmarks/data" in _check(data, "[32 s](benchmarks/data/gone.json#wall_s)")[0]
    assert "not a number" in _check(data, "[32 s](benchmarks/data/run.json#out)")[0]


def test_an_uncited_figure_fails_and_settings_pass(data):
    for md in ("The demo took 32 s.", "peak 1,314 MB", "at 0.92× the speed", "$0.35 planned", "| x | 207.2 |"):
        assert _check(data, md), md
    for md in (
        "the 2-core machine, 8 steps, 391 prompts, 1.1B model, 4 × 1024 tokens, micro-batch 4 x 1024",
        "at $2.99/GPU-hour",
        "[**4.28×**](benchmarks/data/run.json#ratio) (≥ 3×), the goal of 2× missed",
        "```\nteacher 41.6 s\n```",
        "<!-- an old note: 32 s -->",
    ):
        assert _check(data, md) == [], md


def test_a_transcript_is_checked_line_by_line_against_its_recording(data):
    block = "<!-- output: benchmarks/data/run.json#out -->\n```\na line\n...\n  b: 1.5 s\n```\n"
    assert _check(data, block) == []
    bad = block.replace("1.5 s", "1.4 s")
    assert ["transcript line not in run.json#out: 'b: 1.4 s'"] == _check(data, bad)
