"""Several teachers in the teacher stage, on real tiny data (issue 45): the demo cipher teacher answering 60 prompts
as two teachers routed by category (``short`` first, then the default ``general``), without Dagster. A teacher over
its ``budget_share`` is stopped mid-way and the other goes on; the stage commits every finished row, each naming
its teacher, and the cost lines and the cost report say who spent what and who was stopped."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from campaigns.loader import load_campaign_file
from stages.context import StageContext
from stages.storage import Store
from tests.support.campaign_support import demo_teacher, write_campaign

pytestmark = pytest.mark.stage


class Lines:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    warning = info


def teachers(short: dict | None = None) -> list[dict]:
    """The demo teacher as two: ``short`` (the short words, asked 4 prompts a batch so a budget can stop it
    between batches) and the default ``general``."""
    return [
        demo_teacher() | {"name": "short", "categories": ["short"], "batch_size": 4} | (short or {}),
        demo_teacher() | {"name": "general"},
    ]


def test_a_teacher_over_its_budget_share_is_stopped_and_the_other_goes_on(tmp_path, artifact_root):
    from campaign_orchestrator.costs.report import _teacher_text, teacher_spend
    from stages import prompts, teacher_generations

    # a share of a millionth of $1 is less than one batch of the short teacher costs (~$5e-7 for 4 prompts on
    # cpu-2vcpu), so it stops after its first batch; check_estimates off: stopped by what it spent, not a forecast
    spec = load_campaign_file(
        write_campaign(
            tmp_path / "project",
            "shares",
            teachers({"budget_share": 1e-6}),
            prompts=60,
            cost={"budget_usd": 1.0, "check_estimates": False},
        )
    )
    log = Lines()
    ctx = StageContext(store=Store(root=str(artifact_root)), run_id="shares-1", log=log)
    p = prompts.run(spec, {}, ctx).manifest
    m = teacher_generations.run(spec, {"prompts": p}, ctx).manifest

    train = pq.read_table(p["train_path"]).to_pylist()
    n_short = sum(r["category"] == "short" for r in train)
    assert 4 < n_short < len(train)  # both teachers have prompts, the short one more than one batch
    assert set(m["stopped_teachers"]) == {"short"}
    assert "budget_share" in m["stopped_teachers"]["short"]
    t = m["teachers"]
    assert 0 < t["short"]["rows"] < n_short and t["short"]["stopped"]  # stopped mid-way: its finished rows kept
    assert t["general"]["rows"] == len(train) - n_short and t["general"]["generated"] == t["general"]["rows"]
    assert any("teacher short stopped, the others go on" in x for x in log.lines)

    rows = pq.read_table(m["generations_path"]).to_pylist()
    assert len(rows) == m["rows"] == t["short"]["rows"] + t["general"]["rows"]
    cat = {r["id"]: r["category"] for r in train}
    assert {r["teacher"] for r in rows} == {"short", "general"}
    assert all(r["teacher"] == ("short" if cat[r["id"]] == "short" else "general") for r in rows)

    # every cost line names its teacher: the stopped attempt's the guard wrote to the ledger (interrupted), the
    # finished work's travel in the manifest (the assets layer records them, as for one teacher)
    interrupted = ctx.pricing.ledger_at(artifact_root).lines(spec.name, run_id="shares-1")
    assert {x["teacher"] for x in m["cost_lines"]} == {"general"}
    lines = interrupted + [x | {"status": "completed"} for x in m["cost_lines"]]
    assert {x["teacher"] for x in lines} == {"short", "general"}
    assert {x["status"] for x in lines if x["teacher"] == "short"} == {"interrupted"}
    spend = teacher_spend(lines, m)
    assert spend["short"]["usd"] > 1e-6 and spend["short"]["interrupted_usd"] == spend["short"]["usd"]
    assert spend["general"]["usd"] > 0 and spend["general"]["interrupted_usd"] == 0
    text = "; ".join(_teacher_text(n, x) for n, x in spend.items())  # the cost report's `spend per teacher`
    assert "short $" in text and "STOPPED: " in text and "general $" in text

    # the stage is not complete while a teacher is stopped: the next run asks again (and the share, spent, stops
    # the short teacher at once), the general teacher's answers all from its cache
    again = teacher_generations.run(spec, {"prompts": p}, ctx)
    assert not again.cached
    g = again.manifest["teachers"]["general"]
    assert g["generated"] == 0 and g["cache_hits"] == g["rows"]
    assert set(again.manifest["stopped_teachers"]) == {"short"}
