"""The DuckDB cost ledger: lines recorded once per production, whatever retries and cache hits do."""

from __future__ import annotations

import pytest
from dagster import AssetKey, DagsterInstance, Output, RetryPolicy, asset, materialize

from assets.io_manager import ManifestIOManager
from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.stage_dir import StageDir

LINE = {
    "kind": "teacher",
    "price_key": "cpu-2vcpu",
    "quantity": 0.5,
    "unit": "host-hour",
    "unit_price": 0.1,
    "usd": 0.05,
    "as_of": "2025-06-01",
    "tier": "on_demand",
    "catalog_version": "v1",
}


def _commit(root, key="k1", lines=(LINE,)):
    return StageDir(root, "camp", "teacher_generations", key).commit({"cost_lines": list(lines), "wall_seconds": 1.0})


def test_a_production_is_paid_once_retries_and_reuse_add_nothing(tmp_path):
    ledger = Ledger(tmp_path / "ledger.duckdb")
    m = _commit(tmp_path)
    kw = {"campaign": "camp", "asset": "teacher_generations", "manifest": m}
    first = ledger.record_stage(run_id="r1", step_key="s", **kw)
    retry = ledger.record_stage(run_id="r1", step_key="s", attempt=1, **kw)
    reuse = ledger.record_stage(run_id="r2", step_key="s", **kw)
    assert first == {
        "reused": False,
        "spent_usd": 0.05,
        "production_usd": 0.05,
        "produced_by": "r1",
        "lines_paid_by": "r1",
    }
    assert retry["reused"] is False
    assert reuse == {
        "reused": True,
        "spent_usd": 0.0,
        "production_usd": 0.05,
        "produced_by": "r1",
        "lines_paid_by": "r1",
    }
    assert ledger.spent("camp") == pytest.approx(0.05)
    assert ledger.spent("camp", run_id="r1") == pytest.approx(0.05) and ledger.spent("camp", run_id="r2") == 0.0
    assert len(ledger.lines("camp")) == 1
    flags = ledger.query("SELECT run_id, reused FROM materializations ORDER BY run_id")
    assert flags == [{"run_id": "r1", "reused": False}, {"run_id": "r2", "reused": True}]
    # the output deleted and computed again is a new production: it is paid again
    again = _commit(tmp_path)
    assert again["production_id"] != m["production_id"]
    assert ledger.record_stage(run_id="r3", step_key="s", campaign="camp", asset="teacher_generations", manifest=again)[
        "spent_usd"
    ] == pytest.approx(0.05)
    assert ledger.spent("camp") == pytest.approx(0.10)
    # lineage: the lines paid for the output a result used (any run)
    assert [x["run_id"] for x in ledger.lineage_lines("camp", {"teacher_generations": "k1"})] == ["r1", "r3"]


def test_interrupted_spend_is_idempotent_per_run_step_and_attempt(tmp_path):
    ledger = Ledger(tmp_path / "ledger.duckdb")
    kw = {
        "campaign": "camp",
        "asset": "teacher_generations",
        "run_id": "r1",
        "step_key": "s",
        "stage_key": "k1",
        "lines": [LINE],
    }
    ledger.record_interrupted(attempt=0, **kw)
    ledger.record_interrupted(attempt=0, **kw)
    ledger.record_interrupted(attempt=1, **kw)
    rows = ledger.query("SELECT status, attempt, usd FROM cost_lines ORDER BY attempt")
    assert rows == [
        {"status": "interrupted", "attempt": 0, "usd": 0.05},
        {"status": "interrupted", "attempt": 1, "usd": 0.05},
    ]
    runs = ledger.runs("camp")
    assert runs[0]["interrupted_usd"] == pytest.approx(0.10) and runs[0]["teacher_usd"] == 0.0


def test_reading_a_missing_ledger_is_empty_and_creates_nothing(tmp_path):
    ledger = Ledger(tmp_path / "none.duckdb")
    assert ledger.spent("camp") == 0.0 and ledger.runs("camp") == [] and ledger.reports("camp") == []
    assert not ledger.path.exists()


def test_a_dagster_step_retried_after_its_output_was_recorded_does_not_double_count(tmp_path):
    """The IO manager records the manifest; the step then fails and Dagster retries it: the retry
    finds the stage complete, hands the same manifest over again, and the ledger adds nothing."""
    root = tmp_path / "artifacts"
    attempts = []

    @asset(key=AssetKey(["camp", "teacher_generations"]), retry_policy=RetryPolicy(max_retries=2))
    def teacher_generations(context):
        attempts.append(context.retry_number)
        sd = StageDir(root, "camp", "teacher_generations", "k1")
        manifest = sd.manifest() if sd.is_complete() else _commit(root)
        yield Output(manifest)
        if context.retry_number == 0:
            raise RuntimeError("crash after the output was handled (e.g. a lost heartbeat)")

    with DagsterInstance.ephemeral() as instance:
        result = materialize(
            [teacher_generations],
            instance=instance,
            raise_on_error=False,
            resources={"io_manager": ManifestIOManager(root=str(root))},
        )
    assert result.success and attempts == [0, 1]
    ledger = Ledger(root / "cost_ledger.duckdb")
    assert len(ledger.lines("camp")) == 1 and ledger.spent("camp", run_id=result.run_id) == pytest.approx(0.05)
    mats = result.asset_materializations_for_node("camp__teacher_generations")
    # both attempts are this run's own output (not reused), paid in this run (no "paid in run …; nothing in this run")
    assert [(m.metadata["reused"].value, m.metadata["cost"].value) for m in mats] == [(False, "$0.05")] * 2


def test_lines_keep_their_ray_shard_and_an_older_ledger_gains_the_column_without_losing_rows(tmp_path):
    """A generation stage on Ray bills per shard (``shard_cost_lines``: each line tagged ``shard``): the ledger keeps
    the shard id per row (NULL for other lines). A ledger file written before the column existed is migrated when it
    is opened: its rows stay, their shard NULL."""
    import duckdb

    from campaign_orchestrator.costs import ledger as ledger_mod

    path = tmp_path / "old.duckdb"
    old_schema = ledger_mod.SCHEMA.replace(",\n    shard VARCHAR,\n    verified BOOLEAN\n", "\n")
    assert "shard" not in old_schema.split("CREATE TABLE IF NOT EXISTS materializations")[0]
    con = duckdb.connect(str(path))
    con.execute(old_schema)  # the ledger as it was before lines named their shard
    con.execute(
        "INSERT INTO cost_lines VALUES ('old-1', 'camp', 'teacher_generations', 'r0', 's', 0, 'p0', 'k0', "
        "'completed', 'teacher', 'cpu-2vcpu', 0.5, 'host-hour', 0.1, 0.05, NULL, NULL, NULL, now())"
    )
    con.close()
    ledger = Ledger(path)
    shards = [LINE | {"shard": "a1b2c3"}, LINE | {"shard": "d4e5f6"}, LINE]
    ledger.record_stage(
        campaign="camp",
        asset="teacher_generations",
        run_id="r1",
        step_key="s",
        manifest=_commit(tmp_path, key="k1", lines=shards),
    )
    rows = ledger.query("SELECT run_id, shard, usd, verified FROM cost_lines ORDER BY run_id, shard NULLS LAST")
    assert rows == [  # the old row: no shard, and not known to be unverified (the column came later too)
        {"run_id": "r0", "shard": None, "usd": 0.05, "verified": None},
        {"run_id": "r1", "shard": "a1b2c3", "usd": 0.05, "verified": True},
        {"run_id": "r1", "shard": "d4e5f6", "usd": 0.05, "verified": True},
        {"run_id": "r1", "shard": None, "usd": 0.05, "verified": True},
    ]
    assert ledger.spent("camp") == pytest.approx(0.20) and len(ledger.lines("camp")) == 4
    fresh = Ledger(tmp_path / "new.duckdb")  # a new file has the column from the start
    fresh.record_interrupted(
        campaign="camp",
        asset="teacher_generations",
        run_id="r2",
        step_key="s",
        attempt=0,
        stage_key="k2",
        lines=[LINE | {"shard": "0f0f0f"}],
    )
    assert fresh.query("SELECT shard FROM cost_lines") == [{"shard": "0f0f0f"}]
