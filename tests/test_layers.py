"""The layout holds: the layer order in pyproject.toml (import-linter contracts) and no import
cycle between the project's packages, lazy imports included."""

from __future__ import annotations


import grimp
from importlinter.cli import lint_imports

from tests.support import REPO_ROOT as REPO
ROOTS = ("campaigns", "assets", "resources", "training", "evaluation", "campaign_orchestrator")


def unit(module: str) -> str:
    """The package a module belongs to: a top-level package, or a sub-package / module of the library."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "campaign_orchestrator" and len(parts) > 1 else parts[0]


def test_import_linter_contracts_are_kept(monkeypatch):
    monkeypatch.chdir(REPO)
    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True) == 0


def test_no_import_cycle_between_packages():
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    edges: dict[str, set[str]] = {}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = unit(importer), unit(imported)
            if a != b and b.split(".")[0] in ROOTS:
                edges.setdefault(a, set()).add(b)
    # depth-first search for a back edge; report the cycle's packages
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(edges):
        if n not in state:
            cycle = visit(n)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert {"assets", "resources", "campaign_orchestrator.teacher"} <= set(edges)  # the walk saw the project


def test_installed_top_level_names_are_the_five_packages_and_the_library():
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(p.rstrip("*") for p in include) == sorted(ROOTS)
    assert not (REPO / "definitions.py").exists()
