"""Assets stay thin: an asset body reads its slice of the spec, calls a library function and turns its result
into metadata. Every function in ``assets/`` (a factory, the asset it decorates, a helper) is held to
``MAX_LINES`` statements' worth of lines, its docstring not counted: logic that needs more belongs in a plain
module below the assets layer (``evaluation/``, ``training/``, ``campaign_orchestrator/``)."""

import ast
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MAX_LINES = 50


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line (nested functions count
    in their outer function too: a factory is as long as the asset it holds)."""
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return 0 if not body else node.end_lineno - body[0].lineno + 1


def function_lengths(path: Path) -> dict[str, int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        f"{path.name}:{n.lineno} {n.name}": body_lines(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def test_no_function_in_the_assets_package_is_over_the_limit():
    lengths = {k: v for f in sorted(ASSETS.glob("*.py")) for k, v in function_lengths(f).items()}
    assert len(lengths) > 100  # every asset module was read
    over = {k: v for k, v in lengths.items() if v > MAX_LINES}
    assert not over, (
        f"functions in assets/ over {MAX_LINES} lines (move the logic into a plain module below the "
        f"assets layer and keep the asset to spec, one call, metadata): {over}"
    )


def test_the_measure_counts_a_nested_asset_in_its_factory(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        'def build():\n    """Doc."""\n    x = 1\n\n    def inner():\n        return x\n\n    return inner\n'
    )
    assert function_lengths(src) == {"m.py:1 build": 6, "m.py:5 inner": 1}


# --------------------------------------------------------------------------- no choice of backend, engine or executor

# What runs a model and where (issue 44): a backend (openai, vllm, transformers), an engine, an executor (local, ray,
# kuberay, k8s). The stages choose (stages/executors.py: executor_for; stages/teacher.py: the teacher's backend); an
# asset that compares a setting with one of these names has taken the choice back.
RUNNER_NAMES = frozenset({"openai", "vllm", "transformers", "ray", "local", "k8s", "kuberay"})


def _names_in(node: ast.AST) -> set[str]:
    """The runner names among the string constants of ``node`` (a tuple or set of them counts: ``x in ("ray",)``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & RUNNER_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {n for e in node.elts for n in _names_in(e)}
    return set()


def runner_branches(path: Path) -> list[str]:
    """``file:line name`` of every comparison (in an ``if``, an expression, a condition) or ``match`` case on a
    backend, engine or executor name in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Compare):
            names = _names_in(node.left) | {n for c in node.comparators for n in _names_in(c)}
        elif isinstance(node, ast.match_case):
            p = node.pattern
            values = [p] if isinstance(p, ast.MatchValue) else getattr(p, "patterns", [])
            names = {n for v in values if isinstance(v, ast.MatchValue) for n in _names_in(v.value)}
        else:
            continue
        found += [f"{path.name}:{node.lineno if hasattr(node, 'lineno') else node.pattern.lineno} {n}" for n in names]
    return sorted(found)


def test_no_asset_branches_on_a_backend_engine_or_executor_name():
    files = sorted(ASSETS.glob("*.py"))
    assert len(files) > 20  # every asset module was read
    found = [b for f in files for b in runner_branches(f)]
    assert not found, (
        f"assets/ chooses a backend, engine or executor by name: {found}; let the stage choose "
        "(stages/executors.py executor_for, stages/teacher.py) and keep the asset to spec, stage, metadata"
    )


def test_the_branch_finder_sees_ifs_conditions_and_match_cases(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def f(spec):\n"
        "    if spec.teacher.backend == 'openai':\n"
        "        pass\n"
        "    kind = 'python' if spec.execution.executor != \"ray\" else 'ray'\n"
        "    ok = spec.training.launcher in ('k8s', 'other')\n"
        "    match spec.evaluation.backend:\n"
        "        case 'local':\n"
        "            pass\n"
        "    return spec.training.distillation.loss == 'logits'\n"
    )
    assert runner_branches(src) == ["m.py:2 openai", "m.py:4 ray", "m.py:5 k8s", "m.py:7 local"]
