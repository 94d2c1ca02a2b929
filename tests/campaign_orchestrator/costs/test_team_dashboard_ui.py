"""The team dashboard as a person opens it: served by ``campaign dashboard --serve`` (a port of its choosing) and read
in headless Chromium. Three runs of one campaign, reports built as ``campaign run`` builds them: the first produces
every stage and the planner misses two of them (teacher 0.3x its estimate, evaluation 0.09x); the second reuses
everything; the third re-judges only the evaluation, within the band. Every report repeats the plan rows with the
actuals of the outputs it used, so the tile must count the misses of produced stages only: 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from campaign_orchestrator.costs.ledger import Ledger
from tests.campaign_orchestrator.costs.test_dashboard import ARGS, CHROMIUM
from tests.campaign_orchestrator.costs.test_team_dashboard import _line
from tests.support.dashboards import served_dashboards

PLAN = {
    "stages": {
        "teacher_generations": {"usd": 0.010, "seconds": 10.0},
        "student_adapter": {"usd": 0.020, "seconds": 20.0},
        "evaluation": {"usd": 0.010, "seconds": 10.0},
    },
    "total_usd": 0.040,
    "memory": {"total_gb": 1.0, "fits": True},
}
KIND = {"teacher_generations": "teacher", "student_adapter": "training", "evaluation": "evaluation"}
FIRST = {  # stage -> (production id, its spend): what the first run paid
    "teacher_generations": ("c-gen-0000000001", 0.003),  # 0.3x the estimate: a miss
    "student_adapter": ("c-train-00000001", 0.022),  # 1.1x
    "evaluation": ("c-eval-000000001", 0.0009),  # 0.09x: a miss
}


def three_run_ledger(path: Path) -> Ledger:
    """The ledger of the three runs (module docstring), each with the cost report `campaign run` records."""
    from campaign_orchestrator.costs.report import build_report

    ledger = Ledger(path)
    for run_id, fresh in (
        ("run-one", FIRST),
        ("run-two", {}),
        ("run-three", {"evaluation": ("c-eval-000000002", 0.009)}),  # re-judged: 0.9x the estimate
    ):
        manifests = {}
        for stage, (pid, usd) in FIRST.items():
            pid, usd = fresh.get(stage, (pid, usd))
            lines = [_line(KIND[stage], usd)] if stage in fresh else []
            m = {"production_id": pid, "key": pid[-6:], "cost_lines": lines, "wall_seconds": 10.0}
            if stage == "student_adapter":
                m["summary"] = {"peak_memory_mb": 1000.0}  # 1.05 GB against the planned 1.0: in the band
            ledger.record_stage(campaign="c", asset=stage, run_id=run_id, step_key=stage, manifest=m)
            manifests[stage] = m
        report = build_report(
            campaign="c", run_id=run_id, ledger=ledger, manifests=manifests, primary_suite="cipher", plan=PLAN
        )
        ledger.record_report("c", run_id, report)
    return ledger


@pytest.mark.slow
def test_the_served_team_dashboard_counts_two_planner_misses_in_chromium(tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (Debian package `chromium`)")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    three_run_ledger(tmp_path / "cost_ledger.duckdb")
    with served_dashboards(tmp_path, "--port", "0") as (url, _), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            assert page.goto(f"{url}/index.html").ok
            tile = page.locator(".tile", has_text="planner misses")
            misses = tile.locator(".value").inner_text()
            flagged = page.get_by_text("MISS", exact=True).count()
            page.screenshot(path=str(tmp_path / "team-misses.png"), full_page=True)
        finally:
            browser.close()
    assert f"planner misses: {misses}" == "planner misses: 2" and flagged == 2, (misses, flagged)
