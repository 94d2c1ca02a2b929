"""The layout holds: the layer order in pyproject.toml (import-linter contracts) and no import
cycle between the installed top-level packages, lazy imports included; every ``.py`` file under a
package (a script in a folder without ``__init__.py`` too, which the contracts do not see) keeps the order."""

from __future__ import annotations

import ast
import functools
import tomllib
from pathlib import Path

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
                return stack[stack.index(m) :] + [m]
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
    assert {"campaign_app", "assets", "resources", "stages", "training"} <= set(edges)  # the walk saw the project
    assert "campaigns" not in edges  # the bottom layer imports no other package


def test_find_cycle_reports_the_old_layouts_cycles():
    # the package graph before issue 27 (measured): campaigns -> campaign_orchestrator.paths while
    # campaign_orchestrator.dataset -> campaigns; campaign_orchestrator.cli -> assets -> campaign_orchestrator;
    # campaign_orchestrator.cluster -> training -> campaign_orchestrator
    below = {"campaigns", "campaign_orchestrator"}
    old = {
        "campaigns": {"campaign_orchestrator"},
        "campaign_orchestrator": {"campaigns", "assets", "resources", "training", "evaluation"},
        "assets": below | {"resources", "training", "evaluation"},
        "resources": below | {"training"},
        "training": below,
        "evaluation": below,
    }
    cycle = find_cycle(old)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert all(b in old[a] for a, b in zip(cycle, cycle[1:], strict=False))  # a real cycle of that graph
    assert (
        find_cycle({k: v - {"campaign_orchestrator"} for k, v in old.items() if k != "campaign_orchestrator"}) is None
    )


@functools.cache
def module_graph() -> dict[str, set[str]]:
    """The import graph between the project's modules (lazy imports included): module -> the modules it imports."""
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) & graph.modules for m in graph.modules}


def test_no_import_cycle_between_modules():
    """Issue 44 untied dataset.checks <-> dataset.tokenize (and xtok), training.model <-> training.moe and
    stages.evaluation <-> stages.executors: what both sides read sits below them (dataset/tokenizer_files.py,
    training/sharded.py, stages/answers.py). A circle that comes back fails here, naming its modules."""
    graph = module_graph()
    assert "training.moe" in graph and "campaign_orchestrator.dataset.tokenize" in graph  # the walk saw the modules
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def test_training_kernels_import_nothing_of_the_trainer_above_them():
    """The fused kernels sit at the bottom of training/: the LM head's in-forward loss lives with the fused
    cross-entropy (training/kernels/linear_ce.py), and the checks that compare each kernel with the plain path it
    replaces sit above both (training/kernel_checks.py)."""
    graph = module_graph()
    kernels = {m for m in graph if m == "training.kernels" or m.startswith("training.kernels.")}
    assert {"training.kernels.linear_ce", "training.kernels.liger"} <= kernels
    climbs = sorted(
        f"{a} -> {b}"
        for a in kernels
        for b in graph[a]
        if (b == "training" or b.startswith("training.")) and b not in kernels
    )
    assert climbs == []


def test_layers_contract_orders_every_installed_package():
    include = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = sorted(p.rstrip("*") for p in include)
    assert installed == sorted(ROOTS) and len(installed) <= 8
    (top,) = [
        c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["type"] == "layers" and "containers" not in c
    ]
    layered = [name.strip() for layer in top["layers"] for name in layer.split("|")]
    assert sorted(layered) == installed  # one layer list, over the top-level packages
    assert top["layers"][0] == "campaign_app"
    assert not (REPO / "definitions.py").exists()


def layer_rank() -> dict[str, int]:
    """Top-level package -> its layer's index in the contract (0 the top); packages sharing a layer share it."""
    contracts = PYPROJECT["tool"]["importlinter"]["contracts"]
    (top,) = [c for c in contracts if c["type"] == "layers" and "containers" not in c]
    return {name.strip(): i for i, layer in enumerate(top["layers"]) for name in layer.split("|")}


def imported_packages(source: str) -> set[str]:
    """The top-level names a Python source imports, at module level or inside functions (relative imports left out)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def upward_imports(root: Path = REPO) -> list[str]:
    """``file: package`` for every import in a ``.py`` file under a package that names a package of its own layer
    or above (its own package excepted)."""
    rank = layer_rank()
    bad = []
    for pkg, r in rank.items():
        for f in sorted((root / pkg).rglob("*.py")):
            for other in sorted(imported_packages(f.read_text()) & rank.keys() - {pkg}):
                if rank[other] <= r:
                    bad.append(f"{f.relative_to(root)}: {other}")
    return sorted(bad)


def test_every_python_file_under_a_package_keeps_the_layer_order():
    assert upward_imports() == []


def test_upward_imports_sees_a_script_outside_the_modules(tmp_path):
    # the case the contracts miss: a script in a data folder (no __init__.py) of the bottom package
    script = tmp_path / "campaigns" / "data" / "x" / "make.py"
    script.parent.mkdir(parents=True)
    script.write_text("import json\n\ndef main():\n    from campaign_orchestrator import models\n")
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "ok.py").write_text("from campaign_orchestrator import models\nimport evaluation\n")
    assert upward_imports(tmp_path) == ["campaigns/data/x/make.py: campaign_orchestrator", "training/ok.py: evaluation"]


def test_the_tests_mirror_the_code_tree():
    """tests/<package>/<subpackage...>/test_*.py (issue 44): each folder holding tests is the mirror of a code package
    or module (``tests/campaign_orchestrator/sweep/`` for campaign_orchestrator/sweep.py), besides the one end-to-end
    folder and the vLLM tests that run in vLLM's own venv (``make test-heavy``); no two test files share a basename."""
    tests = REPO / "tests"
    files = sorted(tests.rglob("test_*.py"))
    assert len(files) > 100  # the walk saw the suite
    names = [f.name for f in files]
    assert sorted({n for n in names if names.count(n) > 1}) == []
    groups = {("e2e",), ("vllm",)}  # run groups, not code: one end-to-end folder, one for vLLM's venv
    stray = []
    for f in files:
        parts = f.parent.relative_to(tests).parts
        code = REPO.joinpath(*parts)
        if parts and parts not in groups and not (code.is_dir() or code.with_suffix(".py").is_file()):
            stray.append(str(f.relative_to(REPO)))
    assert stray == [], "test files in a folder that mirrors no code package or module"
