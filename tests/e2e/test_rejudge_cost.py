"""A changed evaluation or promotion setting re-judges the stored answers and bills nothing new: through `campaign
run` (as a user runs it) on a priced, shrunken demo in a project of its own, one first run, then each setting that
only changes the evaluation's judgement or the promotion changed in turn. The ledger's total stays what the first
run paid, each rerun says what it re-judged and that it spent nothing, and the cost of the result is the first
run's (the judgement carries the answers' cost lines, owned by the answers' production: costs/ledger.py)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.support.campaign_support import demo_teacher, write_campaign

pytestmark = pytest.mark.slow


def _run(cli, path, artifacts, capsys) -> tuple[int, str]:
    rc = cli.main(["run", str(path), "--artifacts", str(artifacts), "--log-level", "WARNING"])
    return rc, capsys.readouterr().out


def _dollars(out: str, label: str) -> str:
    m = re.search(rf"^{label}: (\$[0-9.]+)", out, re.M)
    assert m, (label, out)
    return m.group(1)


def _edit(path, change) -> None:
    spec = yaml.safe_load(path.read_text())
    change(spec)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))


def test_settings_that_only_rejudge_or_promote_bill_nothing_again(
    tmp_path, artifact_root, monkeypatch, capsys, recwarn
):
    from campaign_app import cli
    from campaign_orchestrator.content import UnresolvedKeyWarning
    from campaign_orchestrator.costs.ledger import Ledger

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    path = write_campaign(tmp_path / "project", "rejudge", demo_teacher(), cost={"budget_usd": 1.0})
    # a gate the two-step student passes (so promotion runs too), with room to tighten each rule
    _edit(path, lambda s: s["evaluation"]["gate"].update(min_score=0.0, max_regression_vs_base=1.0))
    ledger = Ledger(artifact_root / "cost_ledger.duckdb")

    rc, out = _run(cli, path, artifact_root, capsys)
    assert rc == cli.EXIT_OK and "gate verdict: GO" in out, out
    first_run = out.split("dagster run id: ")[1].split()[0]
    total = ledger.spent("rejudge")
    assert total > 0 and ledger.spent("rejudge", asset="evaluation") > 0  # priced: the answers cost something
    result_cost = _dollars(out, "cost of this result")
    # every stage key of the run was made from resolved inputs (campaign_orchestrator.content.stage_key names any
    # `auto`): the template, the compute dtype, the attention kernel left to the run
    assert not [str(w.message) for w in recwarn if issubclass(w.category, UnresolvedKeyWarning)]

    # (a) only a gate threshold: the answers are re-judged, nothing is billed again
    _edit(path, lambda s: s["evaluation"]["gate"].update(min_score=0.05))
    rc, out = _run(cli, path, artifact_root, capsys)
    assert rc in (cli.EXIT_OK, cli.EXIT_BLOCKED), out
    assert f"  evaluation           re-judged (answers from run {first_run[:8]}), nothing spent" in out, out
    assert "ran evaluation; nothing spent" in out and _dollars(out, "spent in this run") == "$0.000000", out
    assert ledger.spent("rejudge") == total
    assert _dollars(out, "cost of this result") == result_cost, out
    # the report says whose actuals the evaluation's are
    assert f"reused (actuals of run {first_run[:8]})" in out, out

    # (b) every other setting that changes only the judgement or the promotion, one at a time
    for name, change in (
        ("a gate rule", lambda s: s["evaluation"]["gate"].update(max_regression_vs_base=0.5)),
        ("a suite's own gate", lambda s: s["evaluation"]["suites"][0].update(gate={"max_empty_output_rate": 0.5})),
        ("the interval's confidence", lambda s: s["evaluation"]["statistics"].update(confidence=0.9)),
        ("approval", lambda s: s["evaluation"].update(requires_human_review=True)),
    ):
        _edit(path, change)
        rc, out = _run(cli, path, artifact_root, capsys)
        assert rc in (cli.EXIT_OK, cli.EXIT_BLOCKED), (name, out)
        assert "re-judged (answers from run" in out and "nothing spent" in out, (name, out)
        assert ledger.spent("rejudge") == total, name
        assert _dollars(out, "spent in this run") == "$0.000000", (name, out)
