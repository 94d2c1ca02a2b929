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
    for page in (
        "teacher",
        "dataset",
        "training",
        "moe",
        "sweeps",
        "evaluation",
        "cost",
        "automation",
        "diagnosis",
        "kubernetes",
        "results",
        "campaign-fields",
    ):
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


# top-level folders whose files a doc may name in backticks (`assets/prompts.py`): each must exist
REPO_FOLDERS = (
    "campaigns/",
    "campaign_orchestrator/",
    "campaign_app/",
    "assets/",
    "resources/",
    "training/",
    "evaluation/",
    "tests/",
    "benchmarks/",
    "docs/",
    "deploy/",
    ".ci/",
)


def test_paths_named_in_docs_exist():
    missing = []
    for page in PAGES:
        for token in re.findall(r"`([^`\s]+)`", page.read_text()):
            path = token.rstrip(".,:;").split("::")[0]
            if path.startswith(REPO_FOLDERS) and not any(c in path for c in "<>*{}$[]"):
                if not (REPO_ROOT / path).exists():
                    missing.append(f"{page.name}: {path}")
    assert not missing, "docs name paths that do not exist:\n" + "\n".join(missing)


# a reference in a YAML comment: README.md or docs/<page>.md, optionally followed by , "Heading" (a prefix of one)
REFERENCE = re.compile(r'(README(?:\.md)?|docs/[\w.-]+)(?:,\s*"([^"]+)")?')


def _headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip().lower() for line in page.read_text().splitlines() if line.startswith("#")]


def test_readme_and_docs_references_in_campaign_yaml_and_dagster_yaml_resolve():
    files = [
        *sorted((REPO_ROOT / "campaigns").glob("*.yaml")),
        *sorted((REPO_ROOT / "campaigns" / "examples").glob("*.yaml")),
        REPO_ROOT / "campaign_app" / "dagster.yaml",
    ]
    broken, seen = [], 0
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            comment = line.partition("#")[2]
            for ref, heading in REFERENCE.findall(comment):
                seen += 1
                where = f"{f.relative_to(REPO_ROOT)}:{n}: {ref}"
                target = REPO_ROOT / ("README.md" if ref.startswith("README") else ref)
                if ref == "README" or not target.is_file():
                    broken.append(f"{where} (name a file that exists: README.md or docs/<page>.md)")
                elif heading and not any(h.startswith(heading.lower()) for h in _headings(target)):
                    broken.append(f'{where}, "{heading}" (no such heading in {target.name})')
    assert seen >= 10 and not broken, "stale references:\n" + "\n".join(broken)


def test_docs_index_is_in_stage_order_and_reaches_every_page():
    index = REPO_ROOT / "docs" / "index.md"
    sections = [h for h in _headings(index)[1:]]
    assert sections == ["1. quickstart", "2. concepts", "3. how-tos", "4. reference", "5. measured results"]
    linked = set(re.findall(r"\]\(([\w.-]+\.md)", index.read_text()))
    pages = {p.name for p in (REPO_ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= linked, f"pages the index does not link: {sorted(pages - linked)}"
    assert "(docs/index.md)" in (REPO_ROOT / "README.md").read_text()
    concepts = (REPO_ROOT / "docs" / "concepts.md").read_text()  # the stages walked in pipeline order
    order = [
        "**prompts**",
        "**teacher_generations**",
        "**distillation_set**",
        "**tokenized_dataset**",
        "**student_adapter**",
        "**evaluation**",
        "**promoted_model**",
        "**campaign_cost**",
    ]
    assert [concepts.index(s) for s in order] == sorted(concepts.index(s) for s in order)


def test_readme_ui_section_names_every_group_the_code_location_builds():
    from assets.location import build_definitions

    groups = {s.group_name for s in build_definitions().resolve_all_asset_specs()}
    text = (REPO_ROOT / "README.md").read_text()
    ui = text[text.index("## The Dagster UI") : text.index("## The `campaign` CLI")]
    assert groups and not {g for g in groups if f"`{g}`" not in ui}, sorted(g for g in groups if f"`{g}`" not in ui)
