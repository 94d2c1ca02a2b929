"""The team's cost dashboard: every campaign in the ledger on one page, over calendar days, served over HTTP
(what the UI's metadata links) and rendered in headless Chromium."""

from __future__ import annotations

import datetime as dt
import json
import re
import threading

import pytest

from campaign_orchestrator.costs import ledger as ledger_module
from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.costs.report import dollars
from tests.campaign_orchestrator.costs.test_dashboard import ARGS, CHROMIUM, _png_pixels

DAY1, DAY2 = dt.datetime(2026, 11, 30, 9, 0), dt.datetime(2026, 12, 1, 14, 0)


def _line(kind: str, usd: float, key: str = "cpu-2vcpu", unit: str = "host-hour", price: float = 0.0893) -> dict:
    return {
        "kind": kind,
        "price_key": key,
        "quantity": usd / price,
        "unit": unit,
        "unit_price": price,
        "usd": usd,
        "as_of": "2025-06-01",
        "tier": "on_demand",
        "catalog_version": "2026-11-29",
    }


def _stage(ledger: Ledger, campaign: str, run: str, asset: str, pid: str, lines: list[dict]) -> None:
    ledger.record_stage(
        campaign=campaign,
        asset=asset,
        run_id=run,
        step_key=asset,
        manifest={"production_id": pid, "key": pid[-6:], "cost_lines": lines},
    )


def _report(campaign: str, run: str, total: float, scores: dict, ratio: float, budget: float | None) -> dict:
    return {
        "campaign": campaign,
        "run_id": run,
        "total_usd": total,
        "verdict": "GO",
        "primary_suite": "cipher",
        "candidate_score": scores["cipher"],
        "suite_scores": scores,
        "base_suite_scores": {"cipher": 0.0},
        "budget_usd": budget,
        "gpu_hours": 0.0,
        "host_hours": 0.1,
        "plan_vs_actual": [
            {
                "stage": "student_adapter",
                "estimated_usd": total / ratio,
                "actual_usd": total,
                "usd_ratio": ratio,
                "estimated_seconds": 10.0,
                "actual_seconds": 10.0 * ratio,
            }
        ],
        "plan_memory_gb": 1.0,
        "actual_peak_memory_gb": 2.1,
    }


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    """Three campaigns over two days: alpha ran on day 1 and reran unchanged on day 2 (reused everything);
    beta generated on day 1 and trained on a GPU on day 2 (over $1k); gamma ran on day 2 only."""
    lg = Ledger(tmp_path / "cost_ledger.duckdb")
    clock = {"now": DAY1}
    monkeypatch.setattr(ledger_module, "_now", lambda: clock["now"])
    _stage(lg, "alpha", "a1", "teacher_generations", "alpha-gen-000001", [_line("teacher", 0.0010)])
    _stage(lg, "alpha", "a1", "student_adapter", "alpha-train-0001", [_line("training", 0.0120)])
    lg.record_report("alpha", "a1", _report("alpha", "a1", 0.0130, {"cipher": 0.9, "format": 0.95}, 1.1, 1.0))
    _stage(lg, "beta", "b1", "teacher_generations", "beta-gen-0000001", [_line("teacher", 0.50)])
    clock["now"] = DAY2
    for asset, pid in (("teacher_generations", "alpha-gen-000001"), ("student_adapter", "alpha-train-0001")):
        _stage(lg, "alpha", "a2", asset, pid, [])  # the unchanged rerun: cache hits, no lines
    _stage(
        lg,
        "beta",
        "b2",
        "student_adapter",
        "beta-train-00001",
        [_line("training", 1234.0, "h100-sxm", "gpu-hour", 2.99)],
    )
    lg.record_report("beta", "b2", _report("beta", "b2", 1234.5, {"cipher": 0.7, "general": 0.4}, 3.0, 2000.0))
    _stage(lg, "gamma", "g1", "evaluation", "gamma-eval-00001", [_line("evaluation", 0.25)])
    return lg


def test_team_series_come_from_the_ledger_rows(ledger):
    from campaign_orchestrator.costs.dashboard import team_data

    d = team_data(ledger)
    expected = {
        (r["day"], r["campaign"]): r["usd"]
        for r in ledger.query(
            "SELECT strftime(recorded_at, '%Y-%m-%d') AS day, campaign, SUM(usd) AS usd FROM cost_lines GROUP BY ALL"
        )
    }
    got: dict = {}
    for r in d["spend_by_day"]:
        got[(r["period"], r["campaign"])] = got.get((r["period"], r["campaign"]), 0.0) + r["usd"]
    assert (
        got.keys()
        == expected.keys()
        == {("2026-11-30", "alpha"), ("2026-11-30", "beta"), ("2026-12-01", "beta"), ("2026-12-01", "gamma")}
    )
    assert all(got[k] == pytest.approx(v) for k, v in expected.items())
    assert {r["period"] for r in d["spend_by_week"]} == {"2026-W49"}  # Monday 30 Nov and Tuesday 1 Dec: one ISO week
    assert [c["campaign"] for c in d["campaigns"]] == ["alpha", "beta", "gamma"]
    assert {(r["campaign"], r["stage"]) for r in d["spend_by_day"]} >= {
        ("beta", "student_adapter"),
        ("alpha", "teacher_generations"),
    }
    gpu = [h for h in d["hardware"] if h["unit"] == "gpu-hour"]
    assert [(h["campaign"], h["resource"]) for h in gpu] == [("beta", "h100-sxm")]
    assert gpu[0]["quantity"] == pytest.approx(1234.0 / 2.99)
    assert {r["run_id"] for r in d["runs"] if r["reused_everything"]} == {"a2"}
    misses = {(p["campaign"], p["stage"]) for p in d["plan"] if p["miss"]}
    assert misses == {("beta", "student_adapter"), ("alpha", "student memory (GB)"), ("beta", "student memory (GB)")}
    beta = next(c for c in d["campaigns"] if c["campaign"] == "beta")
    assert beta["budget_used"] == pytest.approx(1234.5 / 2000.0)
    assert next(r for r in d["runs"] if r["run_id"] == "b2")["scores"] == {"cipher": 0.7, "general": 0.4}


def test_dollars_for_people():
    assert [dollars(x) for x in (0.0005164750059162165, 0.0122, 0.001, 0.25, 3.5, 1234.5, 2.5e6, 0, None)] == [
        "$0.00052",
        "$0.012",
        "$0.001",
        "$0.25",
        "$3.50",
        "$1.2k",
        "$2.5M",
        "$0",
        "n/a",
    ]


def test_the_served_team_dashboard_in_chromium(ledger, tmp_path, capsys):
    from campaign_app.cli import main
    from campaign_app.cli.costs import serve

    assert main(["dashboard", "--artifacts", str(tmp_path)]) == 0
    page = tmp_path / "dashboards" / "index.html"
    assert capsys.readouterr().out.strip() == str(page)
    servers = []
    t = threading.Thread(target=serve, args=(page.parent, 0, servers.append), daemon=True)
    t.start()
    for _ in range(100):
        if servers:
            break
        threading.Event().wait(0.05)
    url = f"http://127.0.0.1:{servers[0].server_address[1]}/index.html"
    shot = tmp_path / "team.png"
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            try:
                tab = browser.new_page(viewport={"width": 1300, "height": 900})
                assert tab.goto(url).ok
                text = tab.inner_text("body")
                data = json.loads(tab.inner_text("#team-data"))
                bars = [
                    (b.get_attribute("data-period"), b.get_attribute("data-campaign"))
                    for b in tab.locator("rect.spend").all()
                ]
                tab.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
    finally:
        servers[0].shutdown()
    assert sorted(bars) == [
        ("2026-11-30", "alpha"),
        ("2026-11-30", "beta"),
        ("2026-12-01", "beta"),
        ("2026-12-01", "gamma"),
    ]  # one stacked segment per day and campaign that spent
    for needle in (
        "Team cost dashboard",
        "2026-11-30",
        "2026-12-01",
        "2026-W49",
        "alpha",
        "beta",
        "gamma",
        "$1.2k",
        "$0.013",
        "h100-sxm",
        "MISS",
        "reused everything",
        "cipher 70.0%, general 40.0%",
    ):
        assert needle in text, needle
    assert data["spend_by_day"] and {r["campaign"] for r in data["runs"]} == {"alpha", "beta", "gamma"}
    assert len(set(_png_pixels(shot)[::7])) > 30  # a real picture, not a blank page


def test_planner_misses_count_once_per_produced_stage(tmp_path):
    """Three runs of one campaign, reports built as `campaign run` builds them: the first produces every stage
    and the planner misses two (teacher 0.3×, evaluation 0.09×); the second reuses everything; the third
    re-judges only the evaluation (a changed gate threshold), within the band. Each report repeats the plan rows
    with the actuals of the outputs it used, so counting rows gave 2 + 2 + 1 misses (and a reused teacher read
    MISS): the tile says 2, and every reused row reads reused, from the run that produced it."""
    from campaign_orchestrator.costs.dashboard import render_team_dashboard, team_data
    from campaign_orchestrator.costs.report import build_report

    lg = Ledger(tmp_path / "cost_ledger.duckdb")
    plan = {
        "stages": {
            "teacher_generations": {"usd": 0.010, "seconds": 10.0},
            "student_adapter": {"usd": 0.020, "seconds": 20.0},
            "evaluation": {"usd": 0.010, "seconds": 10.0},
        },
        "total_usd": 0.040,
        "memory": {"total_gb": 1.0, "fits": True},
    }
    produced = {  # stage -> (production id, its spend): what the first run paid
        "teacher_generations": ("c-gen-0000000001", 0.003),  # 0.3× the estimate: a miss
        "student_adapter": ("c-train-00000001", 0.022),  # 1.1×
        "evaluation": ("c-eval-000000001", 0.0009),  # 0.09×: a miss
    }

    def run(run_id: str, fresh: dict[str, tuple[str, float]]) -> None:
        manifests = {}
        for stage, (pid, usd) in produced.items():
            pid, usd = fresh.get(stage, (pid, usd))
            lines = [_line(SPEND[stage], usd)] if stage in fresh else []
            m = {"production_id": pid, "key": pid[-6:], "cost_lines": lines, "wall_seconds": 10.0}
            if stage == "student_adapter":
                m["summary"] = {"peak_memory_mb": 1000.0}  # 1.05 GB against the planned 1.0: in the band
            lg.record_stage(campaign="c", asset=stage, run_id=run_id, step_key=stage, manifest=m)
            manifests[stage] = m
        report = build_report(
            campaign="c", run_id=run_id, ledger=lg, manifests=manifests, primary_suite="cipher", plan=plan
        )
        lg.record_report("c", run_id, report)

    SPEND = {"teacher_generations": "teacher", "student_adapter": "training", "evaluation": "evaluation"}
    run("run-one", produced)
    run("run-two", {})
    run("run-three", {"evaluation": ("c-eval-000000002", 0.009)})  # re-judged: 0.9× the estimate

    d = team_data(lg)
    rows = {(p["run_id"], p["stage"]): p for p in d["plan"]}
    assert len(rows) == 12  # three runs × (three stages + the student's memory): every report repeats the plan
    assert {k for k, p in rows.items() if p["miss"]} == {
        ("run-one", "teacher_generations"),
        ("run-one", "evaluation"),
    }
    assert {k for k, p in rows.items() if p["produced_here"]} == {
        ("run-one", "teacher_generations"),
        ("run-one", "student_adapter"),
        ("run-one", "evaluation"),
        ("run-one", "student memory (GB)"),
        ("run-three", "evaluation"),
    }
    for (run_id, stage), p in rows.items():
        if not p["produced_here"]:  # a reused teacher or evaluation reads like a reused student_adapter
            assert p["reused"] and p["reused_from_run"] == "run-one", (run_id, stage, p)
    page = render_team_dashboard(lg)
    assert re.search(r'planner misses</div><div class="value warn">2</div>', page)
    assert page.count('<span class="warn">MISS</span>') == 2
    assert page.count("reused (from run run-one)") == 7
