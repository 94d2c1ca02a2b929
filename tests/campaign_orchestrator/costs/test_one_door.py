"""Cost goes through one door (issues 27, 44): stages price and guard their spend through ``stages/pricing.py``
only (assets and resources import no cost module; the pricing resource only configures it), ledger SQL lives in
the ledger module only, and following a stage's billing call to its ledger line
stays short (a few project files, a few returns between them)."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

from campaigns.loader import load_campaign_file
from tests.support import REPO_ROOT

PACKAGES = (
    "assets",
    "resources",
    "stages",
    "campaign_orchestrator",
    "campaign_app",
    "campaigns",
    "training",
    "evaluation",
)
LEDGER = REPO_ROOT / "campaign_orchestrator" / "costs" / "ledger.py"
# the project writes SQL keywords in capitals (prose such as "turns events into materializations" is not SQL)
LEDGER_SQL = re.compile(
    r"\b(FROM|INTO|JOIN|UPDATE|TABLE(\s+IF\s+NOT\s+EXISTS)?)\s+(cost_lines|materializations|"
    r"cost_reports)\b"
)
MAX_FILES, MAX_RETURNS = 6, 6


def cost_imports(path: Path) -> list[str]:
    """``line: module`` of every import of a ``campaign_orchestrator.costs`` module in ``path``, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found += [
            f"{node.lineno}: {m}"
            for m in mods
            if m == "campaign_orchestrator.costs" or m.startswith("campaign_orchestrator.costs.")
        ][:1]
    return sorted(found, key=lambda x: int(x.split(":")[0]))


DOOR = REPO_ROOT / "stages" / "pricing.py"


def test_only_the_stages_pricing_module_imports_cost_code(tmp_path):
    files = [p for pkg in ("assets", "resources", "stages") for p in sorted((REPO_ROOT / pkg).rglob("*.py"))]
    assert DOOR in files and cost_imports(DOOR)  # the door itself imports cost code (the walk sees it)
    offenders = {str(p.relative_to(REPO_ROOT)): cost_imports(p) for p in files if p != DOOR}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, (
        f"campaign_orchestrator.costs imported outside {DOOR.relative_to(REPO_ROOT)}: {offenders}; price and guard "
        "through stages.pricing.Pricing (.bill / .guard) instead"
    )
    # the walk sees lazy imports and `from campaign_orchestrator import costs` alike (it can fail)
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n    from campaign_orchestrator.costs.catalog import compute_line\n"
        "from campaign_orchestrator.costs import budget\nimport campaign_orchestrator.costs.ledger\n"
    )
    assert cost_imports(bad) == [
        "2: campaign_orchestrator.costs.catalog",
        "3: campaign_orchestrator.costs",
        "4: campaign_orchestrator.costs.ledger",
    ]


def test_no_ledger_sql_outside_the_ledger_module():
    assert LEDGER_SQL.search(LEDGER.read_text())  # the pattern finds the ledger's own SQL (it can fail)
    offenders = [
        f"{p.relative_to(REPO_ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for pkg in PACKAGES
        for p in sorted((REPO_ROOT / pkg).rglob("*.py"))
        if p != LEDGER
        for text in [p.read_text()]
        for m in LEDGER_SQL.finditer(text)
    ]
    assert not offenders, (
        f"ledger SQL outside {LEDGER.relative_to(REPO_ROOT)}: {offenders}; add a Ledger method there and call it"
    )


# --------------------------------------------------------------------------- the walk from a billing call


@functools.cache
def _project_file(filename: str) -> str | None:
    p = Path(filename)
    try:
        rel = p.resolve().relative_to(REPO_ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in PACKAGES else None


def walk(fn, *args, **kwargs):
    """Run ``fn`` traced: (its result, the project files it visited, the returns from a callee back into
    another project file: the nearest project frame below the returning one is in a different file)."""
    files: set[str] = set()
    returns: list[str] = []

    def caller_file(frame):
        f = frame.f_back
        while f is not None:
            name = _project_file(f.f_code.co_filename)
            if name is not None:
                return name
            f = f.f_back
        return None

    def profile(frame, event, _arg):
        if event not in ("call", "return"):
            return
        name = _project_file(frame.f_code.co_filename)
        if name is None:
            return
        if event == "call":
            files.add(name)
        else:
            back = caller_file(frame)
            if back is not None and back != name:
                returns.append(f"{frame.f_code.co_name} ({name}) -> {back}")

    sys.setprofile(profile)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return out, files, returns


@pytest.mark.parametrize(
    "stage, usage, kind",
    [
        ("student_adapter", {"seconds": 90.0, "device": "cpu"}, "training"),
        ("teacher_generations", {"seconds": 12.0, "prompt_tokens": 1000, "completion_tokens": 500}, "teacher"),
    ],
)
def test_a_stage_billing_call_reaches_its_ledger_line_in_a_short_walk(stage, usage, kind):
    """The demo campaign's billing call as its stage makes it (ctx.pricing.bill), traced to the line it returns."""
    from stages.pricing import Pricing

    spec = load_campaign_file(REPO_ROOT / "campaigns" / "demo.yaml")
    pricing = Pricing()
    bill, files, returns = walk(pricing.bill, spec, stage, usage)
    assert [line["kind"] for line in bill["lines"]] == [kind] and bill["usd"] > 0
    assert bill == pricing.bill(spec, stage, usage)  # untraced, the same
    assert "stages/pricing.py" in files and "campaign_orchestrator/costs/catalog.py" in files
    assert len(files) <= MAX_FILES, f"{stage}: the billing walk visits {len(files)} project files: {sorted(files)}"
    assert len(returns) <= MAX_RETURNS, f"{stage}: {len(returns)} returns between files: {returns}"
    print(f"{stage}: {len(files)} files {sorted(files)}, {len(returns)} returns between files")
