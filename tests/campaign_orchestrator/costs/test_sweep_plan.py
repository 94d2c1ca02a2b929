"""The planner's sweep estimate (the sum over rungs of surviving trials × that rung's new steps) and the
sweep panel of the cost dashboard, from a sweep result and the ledger's lines per trial."""

import pytest

from campaign_orchestrator.costs.dashboard import render_dashboard, sweep_panel_data
from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.sweep import plan_rungs
from campaigns.loader import parse_campaign_text
from stages.pricing import Pricing
from tests.support import REPO_ROOT as REPO


def test_plan_rungs_and_the_planner_estimate(artifact_root):
    spec = parse_campaign_text((REPO / "campaigns" / "demo_sweep.yaml").read_text(), "campaigns/demo_sweep.yaml")
    rungs = plan_rungs(spec.sweep, spec.training.max_steps)
    # 6 trials, eta 3: 6 run 30 steps, 2 go on to 90 (60 more), 1 to 270 (180 more)
    assert [(r["trials"], r["steps"], r["new_steps"]) for r in rungs] == [(6, 30, 30), (2, 90, 60), (1, 270, 180)]
    plan = Pricing().plan(spec, artifact_root)
    sw, ad = plan.stages["hparam_sweep"], plan.stages["student_adapter"]
    startup = 8.0  # cpu-2vcpu perf.train_startup_s
    step_s = (ad.seconds - startup) / ad.steps
    assert sw.steps == 6 * 30 + 2 * 60 + 180 == 480
    assert sw.seconds == pytest.approx(480 * step_s + (6 + 2 + 1) * startup)
    assert sw.every_trial_to_the_end_seconds == pytest.approx(6 * (270 * step_s + startup))
    assert sw.usd == pytest.approx(sw.seconds / 3600 * 0.0893) and sw.within_cap is True
    assert plan.total_usd == pytest.approx(sum(s.usd for s in plan.stages.values()))
    from campaign_orchestrator.costs.plan.render import render_plan

    assert "6 trials, rungs 6×30 → 2×90 → 1×270, 480 steps, cap $0.02" in render_plan(plan)


def _line(usd):
    return [
        {
            "kind": "training",
            "price_key": "cpu-2vcpu",
            "quantity": usd / 0.0893,
            "unit": "host-hour",
            "unit_price": 0.0893,
            "usd": usd,
            "as_of": "2025-06-01",
            "tier": "on_demand",
            "catalog_version": "x",
        }
    ]


def test_dashboard_sweep_panel_marks_pruned_trials_and_costs_each_from_the_ledger(tmp_path):
    ledger = Ledger(tmp_path / "ledger.duckdb")
    trials = [
        {
            "trial": 0,
            "root": 0,
            "state": "COMPLETE",
            "params": {"training.learning_rate": 0.01},
            "rungs": {"30": {"value": 0.6, "usd": 0.001}, "90": {"value": 0.05, "usd": 0.002}},
            "usd": 0.003,
        },
        {
            "trial": 1,
            "root": 1,
            "state": "PRUNED",
            "params": {"training.learning_rate": 1.0},
            "rungs": {"30": {"value": 3.2, "usd": 0.001}},
            "usd": 0.001,
        },
        {
            "trial": 2,
            "root": 2,
            "state": "PRUNED",
            "params": {"training.learning_rate": 1.0e-4},
            "rungs": {"30": {"value": float("inf"), "usd": 0.001}},
            "usd": 0.001,
        },
    ]
    for t in trials:
        for steps, r in t["rungs"].items():
            ledger.record_lines(
                campaign="demo",
                asset="hparam_sweep",
                run_id="run-1",
                step_key="s",
                attempt=0,
                production_id=f"hparam_sweep:k1:trial-{t['root']:03d}:rung-{steps}",
                stage_key="k1",
                lines=_line(r["usd"]),
            )
    ledger.record_lines(
        campaign="demo",
        asset="hparam_sweep",
        run_id="run-1",
        step_key="s",
        attempt=0,  # same rung
        production_id="hparam_sweep:k1:trial-000:rung-30",
        stage_key="k1",
        lines=_line(0.001),
    )
    sweep = {
        "key": "k1",
        "study": "demo-k1",
        "rungs": [30, 90],
        "trials": trials,
        "trials_run": 3,
        "trials_pruned": 2,
        "pruned_at_first_rung": 2,
        "trials_complete": 1,
        "trials_stopped_by_cap": 0,
        "best_trial": 0,
        "best_params": {"training.learning_rate": 0.01},
        "best_value": 0.05,
        "default_value": 0.05,
        "spent_usd": 0.005,
        "cap_usd": 0.01,
        "stopped_by_cap": None,
        "time_saved_seconds": 40.0,
        "trial_seconds": 60.0,
        "every_trial_to_the_end_seconds": 100.0,
    }
    html = render_dashboard("demo", ledger, 1.0, sweep=sweep_panel_data(sweep))
    panel = html[html.index('id="sweep"') :]
    assert "$0.003" in panel and panel.count("$0.001<") >= 2  # per trial, from the ledger (recorded once)
    assert "of a $0.01 cap (50%)" in panel and "40 s" in panel and "(40% less)" in panel
    assert panel.count("<td>PRUNED</td>") == 2 and "<td>#0 (best)</td>" in panel
    assert panel.count('stroke-width="2.5"') == 2  # a cross at the end of each pruned trial's line
    assert "inf" in panel  # a diverged trial's loss is shown as such, drawn at the top edge
