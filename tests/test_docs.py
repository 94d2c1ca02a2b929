"""The README stays short and every link in it and in docs/ resolves (file and heading)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    out, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            text = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def test_readme_is_short():
    n = len((REPO_ROOT / "README.md").read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines (at most 300): move the detail to a page under docs/ and link it"


def test_every_stage_has_a_page():
    for page in ("teacher", "dataset", "training", "moe", "sweeps", "evaluation", "cost", "automation", "diagnosis",
                 "kubernetes", "results", "campaign-fields"):
        assert (REPO_ROOT / "docs" / f"{page}.md").exists(), page


def test_links_resolve():
    broken = []
    for page in PAGES:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page.resolve()
            if not target.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.name}: {link} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
