"""The sweep's dollar cap is hard: every rung's launch carries the training BudgetGuard sized to what is left of
the cap, so a rung whose estimate was too low is stopped inside it and the sweep's spend never passes the cap;
a failed planner estimate under a cap is an error, never a $0 rung. The real Sweep, Optuna study (SQLite),
BudgetGuard and DuckDB ledger; the rung's launch is a stand-in that ticks its guard the way the launchers do
(once per poll) on a simulated device clock, so the figures are exact."""

from __future__ import annotations

import pytest
import yaml

from campaign_orchestrator.costs.budget import BudgetGuard, Limit
from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.sweep import RungOutcome, Sweep, default_storage, make_storage
from campaigns.loader import load_campaigns
from tests.support import REPO_ROOT as REPO

pytestmark = pytest.mark.stage

USD_PER_S = 0.001  # the stand-in hardware's price
POLL_S = 0.5  # device seconds between two guard checks (the local launcher polls every 0.5 s)
S_PER_STEP = 0.1  # a rung of 30 steps: 3 s, $0.003; 90 steps: 60 more, $0.006


def _spec(tmp_path, cap: float):
    data = yaml.safe_load((REPO / "campaigns" / "demo_sweep.yaml").read_text())
    data["training"]["max_steps"] = 90
    data["sweep"] |= {"budget_usd": cap, "trials": 6, "enqueue": [], "parallel": 1}
    path = tmp_path / "demo_sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_campaigns([str(path)]).campaigns["demo_sweep"]


def _line(seconds: float) -> list[dict]:
    return [
        {
            "kind": "training",
            "price_key": "stand-in",
            "quantity": seconds / 3600,
            "unit": "host-hour",
            "unit_price": USD_PER_S * 3600,
            "usd": seconds * USD_PER_S,
        }
    ]


def test_a_rung_is_stopped_inside_when_the_cap_is_reached_and_spend_stays_within_it(tmp_path):
    cap = 0.0105  # the first rungs fit; the estimate ($0.0001 a rung) is far too low, so only the guard holds it
    spec = _spec(tmp_path, cap)
    ledger = Ledger(tmp_path / "ledger.duckdb")
    ran: list[tuple[int, int, float]] = []  # (trial, steps, device seconds it ran)

    def spent() -> float:
        return ledger.spent("demo_sweep", asset="hparam_sweep")

    def make_guard(rec, steps, limits):
        clock = {"t": 0.0}
        g = BudgetGuard(
            ledger=ledger,
            campaign="demo_sweep",
            stage="hparam_sweep",
            run_id="r",
            step_key="sweep",
            attempt=0,
            stage_key="k",
            limits=[Limit(w, cap, 0.0, spent_now=fn) for w, cap, fn in limits],
            line_fn=lambda s, _n: _line(s),
            clock=lambda: clock["t"],
            log=lambda m: None,
            part=f"trial-{rec.root:03d}:rung-{steps}",
        )
        g.sim = clock
        return g

    def run_rung(rec, tdir, steps, prev, budget=None):  # a launch: the guard is checked at every poll
        need = (steps - prev) * S_PER_STEP
        try:
            while budget.sim["t"] < need:
                budget.sim["t"] = min(need, budget.sim["t"] + POLL_S)
                budget.check()
        finally:
            ran.append((rec.number, steps, budget.sim["t"]))
        lr = rec.params["training.learning_rate"]
        return RungOutcome(
            value=abs(lr - 1e-2) + 1.0 / steps, seconds=need, lines=_line(need), trained_steps=steps - prev
        )

    def record_lines(rec, steps, lines):
        ledger.record_lines(
            campaign="demo_sweep",
            asset="hparam_sweep",
            run_id="r",
            step_key="sweep",
            attempt=0,
            production_id=f"hparam_sweep:k:trial-{rec.root:03d}:rung-{steps}",
            stage_key="k",
            lines=lines,
        )

    url = default_storage(tmp_path, "demo_sweep")
    sweep = Sweep(
        spec,
        tmp_path / "work",
        make_storage(url, spec.sweep),
        "demo_sweep-k",
        run_rung=run_rung,
        estimate_usd=lambda steps, _n: 0.0001,
        spent_usd=spent,
        record_lines=record_lines,
        log=lambda m: None,
        make_guard=make_guard,
    )
    result = sweep.run()

    total = spent()
    assert total <= cap + 1e-12, (total, cap)  # the cap, not the cap plus a rung
    stopped = [t for t in result["trials"] if t["state"] == "STOPPED"]
    assert len(stopped) == 1 and result["trials_run"] < spec.sweep.trials
    assert "stopped inside its rung" in result["stopped_by_cap"] and "sweep cap" in result["stopped_by_cap"]
    # the stopped rung ran part-way, and stopped when one more poll would have passed the cap
    last_trial, last_steps, last_s = ran[-1]
    assert 0 < last_s < (last_steps - (30 if last_steps == 90 else 0)) * S_PER_STEP
    assert total + POLL_S * USD_PER_S > cap
    # its spend is in the ledger once, as interrupted; in the sweep's figures too
    rows = ledger.query("SELECT status, usd FROM cost_lines WHERE asset = 'hparam_sweep' ORDER BY recorded_at")
    assert [r["status"] for r in rows].count("interrupted") == 1
    assert next(r["usd"] for r in rows if r["status"] == "interrupted") == pytest.approx(last_s * USD_PER_S)
    assert result["spent_usd"] == pytest.approx(total) and stopped[0]["usd"] > 0
    # the stopped rung wrote no rung file: a rerun under a raised cap trains it (from its checkpoint)
    assert not (tmp_path / "work" / f"trial-{last_trial:03d}" / f"rung-{last_steps}.json").exists()


def test_a_failed_plan_under_a_cap_is_an_error_not_a_free_rung(tmp_path, artifact_root):
    """The real hparam_sweep asset, its planner failing: it raises before any launch, naming the cause."""
    from dagster import Failure, build_asset_context

    from assets import hparam_sweep
    from resources.pricing import PricingResource
    from resources.storage import ArtifactStore
    from stages.pricing import Pricing

    class BrokenPlan(Pricing):
        def plan(self, spec, artifact_root):
            raise ValueError("teacher model directory missing")

    class BrokenPlanner(PricingResource):
        def service(self):
            return BrokenPlan()

    class NoLaunch:
        def launch(self, *a, **k):
            raise AssertionError("a rung was launched without an estimate")

    spec = _spec(tmp_path, 0.02)
    asset_def = hparam_sweep.build(spec)
    with build_asset_context(
        resources={
            "storage": ArtifactStore(root=str(artifact_root)),
            "launcher": NoLaunch(),
            "pricing": BrokenPlanner(),
        }
    ) as ctx:
        with pytest.raises(Failure, match=r"could not estimate a rung.*teacher model directory missing.*campaign plan"):
            asset_def(context=ctx, dataset={"key": "d1", "dataset_path": "x", "validation_path": "y"})
