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
