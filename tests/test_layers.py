"""The layout holds: the layer order in pyproject.toml (import-linter contracts) and no import
cycle between the installed top-level packages, lazy imports included."""

from __future__ import annotations

import tomllib

import grimp
from importlinter.cli import lint_imports

from tests.support import REPO_ROOT as REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ROOTS = tuple(PYPROJECT["tool"]["importlinter"]["root_packages"])


def package_graph(roots: tuple[str, ...] = ROOTS) -> dict[str, set[str]]:
    """The import graph squashed to top-level packages: package -> the packages it imports (lazily or not)."""
    graph = grimp.build_graph(*roots, cache_dir=None)
    edges: dict[str, set[str]] = {}
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = importer.split(".")[0], imported.split(".")[0]
            if a != b and b in roots:
                edges.setdefault(a, set()).add(b)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its nodes, the first repeated at the end), or None when it has none."""
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
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_import_linter_contracts_are_kept(monkeypatch):
    monkeypatch.chdir(REPO)
    assert lint_imports(config_filename=str(REPO / "pyproject.toml"), no_cache=True) == 0


def test_no_import_cycle_between_top_level_packages():
    edges = package_graph()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)
    assert {"campaign_app", "assets", "resources", "training"} <= set(edges)  # the walk saw the project
    assert "campaigns" not in edges  # the bottom layer imports no other package


def test_find_cycle_reports_the_old_layouts_cycles():
    # the package graph before issue 27 (measured): campaigns -> campaign_orchestrator.paths while
    # campaign_orchestrator.dataset -> campaigns; campaign_orchestrator.cli -> assets -> campaign_orchestrator;
    # campaign_orchestrator.cluster -> training -> campaign_orchestrator
    below = {"campaigns", "campaign_orchestrator"}
    old = {"campaigns": {"campaign_orchestrator"},
           "campaign_orchestrator": {"campaigns", "assets", "resources", "training", "evaluation"},
           "assets": below | {"resources", "training", "evaluation"}, "resources": below | {"training"},
           "training": below, "evaluation": below}
    cycle = find_cycle(old)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert all(b in old[a] for a, b in zip(cycle, cycle[1:]))  # a real cycle of that graph
    assert find_cycle({k: v - {"campaign_orchestrator"} for k, v in old.items() if k != "campaign_orchestrator"}) is None


def test_layers_contract_orders_every_installed_package():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = sorted(p.rstrip("*") for p in include)
    assert installed == sorted(ROOTS) and len(installed) <= 7
    (top,) = [c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["type"] == "layers" and "containers" not in c]
    layered = [name.strip() for layer in top["layers"] for name in layer.split("|")]
    assert sorted(layered) == installed  # one layer list, over the top-level packages
    assert top["layers"][0] == "campaign_app"
    assert not (REPO / "definitions.py").exists()
