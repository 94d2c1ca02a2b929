"""The campaign_cost asset (metadata Dagster plots, a dashboard link), the `campaign run` summary of
a gate-blocked run, and the dashboard rendered in headless Chromium."""

from __future__ import annotations

import json
import struct
import uuid
import zlib
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import AssetKey, AssetSpec, DagsterInstance, Definitions, define_asset_job

from campaign_orchestrator.costs.ledger import Ledger
from campaign_orchestrator.stage_dir import StageDir
from campaigns.loader import resolve_campaign
from tests.support.dashboards import served_here

RUN_2 = str(uuid.uuid4())
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _hours(kind, usd, price=0.0893):
    return [
        {
            "kind": kind,
            "price_key": "cpu-2vcpu",
            "quantity": usd / price,
            "unit": "host-hour",
            "unit_price": price,
            "usd": usd,
            "as_of": "2025-06-01",
            "tier": "on_demand",
            "catalog_version": "2026-11-29",
        }
    ]


def _record(root: Path, run_id: str, stage: str, key: str, manifest: dict) -> dict:
    """Commit a stage output as the stage would, point LATEST.json at it, record it as the IO manager does."""
    m = StageDir(root, "demo", stage, key).commit(manifest)
    (root / "demo" / stage / "LATEST.json").write_text(json.dumps(m))
    Ledger(root / "cost_ledger.duckdb").record_stage(
        campaign="demo", asset=stage, run_id=run_id, step_key=stage, manifest=m
    )
    return m


def _evaluation(root: Path, run_id: str, key: str, cand: list[int], verdict: str, usd: float) -> dict:
    d = root / "demo" / "evaluation" / key
    d.mkdir(parents=True)
    rows = [
        {"suite": "cipher", "model": m, "item_id": f"i{i}", "score": float(v)}
        for m, scores in (("candidate", cand), ("base", [0] * len(cand)))
        for i, v in enumerate(scores)
    ]
    pq.write_table(pa.Table.from_pylist(rows), d / "items.parquet")
    (d / "gate.json").write_text(
        json.dumps(
            {
                "verdict": verdict,
                "reasons": [] if verdict == "GO" else ["cipher: floor"],
                "markdown": "| gate |",
                "suites": [{"suite": "cipher"}],
            }
        )
    )
    score = sum(cand) / len(cand)
    return _record(
        root,
        run_id,
        "evaluation",
        key,
        {
            "items_path": str(d / "items.parquet"),
            "gate_path": str(d / "gate.json"),
            "verdict": verdict,
            "scores": {"candidate": {"cipher": score}, "base": {"cipher": 0.0}},
            "candidate_key": key,
            "wall_seconds": 50.0,
            "cost_lines": _hours("evaluation", usd),
        },
    )


@pytest.fixture
def campaign(artifact_root):
    """Two runs of the demo campaign in the ledger: run-1 produced everything and was blocked
    (candidate 4%); run-2 reused the teacher's output, trained again and passed (candidate 90%)."""
    root = artifact_root
    _record(
        root,
        "run-1",
        "teacher_generations",
        "g1",
        {
            "prompt_tokens": 30_000,
            "completion_tokens": 20_000,
            "rows": 2000,
            "wall_seconds": 40.0,
            "cost_lines": _hours("teacher", 0.0010),
        },
    )
    _record(root, "run-1", "distillation_set", "d1", {"rows": 1600, "cost_lines": []})
    _record(root, "run-1", "tokenized_dataset", "t1", {"rows": 1600, "cost_lines": []})
    _record(
        root,
        "run-1",
        "student_adapter",
        "a1",
        {
            "summary": {"tokens": 100_000, "train_seconds": 500.0},
            "wall_seconds": 520.0,
            "cost_lines": _hours("training", 0.0120),
        },
    )
    _evaluation(root, "run-1", "e1", [1] * 2 + [0] * 48, "NO-GO", 0.0015)
    ledger = Ledger(root / "cost_ledger.duckdb")
    gen = json.loads((root / "demo/teacher_generations/LATEST.json").read_text())
    for stage in ("teacher_generations", "distillation_set", "tokenized_dataset"):  # cache hits in run-2
        ledger.record_stage(
            campaign="demo",
            asset=stage,
            run_id=RUN_2,
            step_key=stage,
            manifest=json.loads((root / "demo" / stage / "LATEST.json").read_text()),
        )
    _record(
        root,
        RUN_2,
        "student_adapter",
        "a2",
        {
            "summary": {"tokens": 100_000, "train_seconds": 400.0, "peak_memory_mb": 600.0},
            "wall_seconds": 420.0,
            "cost_lines": _hours("training", 0.0100),
        },
    )
    _evaluation(root, RUN_2, "e2", [1] * 45 + [0] * 5, "GO", 0.0012)
    return root, gen


def test_cost_asset_metadata_and_the_dashboard_in_chromium(campaign, tmp_path, capsys):
    from assets import campaign_cost as cost
    from assets.location import default_resources
    from stages import campaign_cost as cost_stage

    root, _gen = campaign
    spec, _ = resolve_campaign("demo")
    ledger = Ledger(root / "cost_ledger.duckdb")
    # the blocked run-1: campaign_cost was skipped; `campaign run` builds its report from the ledger
    from campaign_app.cli.run import campaign_summary, print_summary

    blocked = campaign_summary(root, "demo", "cipher", run_id="run-1", spec=spec)
    assert blocked["cost"]["total_usd"] == pytest.approx(0.0145)
    assert blocked["cost"]["usd_per_point_gained_lcb"] is None  # 4% vs 0% on 50 items: lower bound < 0

    # run-2 materializes campaign_cost itself (upstream manifests come through the IO manager), while `campaign
    # dashboard --serve --port 0` serves the dashboards at a port of its choosing: the UI's links follow it
    assert cost_stage.dashboards_url(root) == "http://127.0.0.1:8765"  # before anything served them
    defs = Definitions(
        assets=[cost.build(spec), *[AssetSpec(AssetKey(["demo", s])) for s in cost_stage.STAGES]],
        jobs=[define_asset_job("cost_only", selection=[AssetKey(["demo", "campaign_cost"])])],
        resources=default_resources(str(root)),
    )
    with served_here(root, "--port", "0") as url:
        assert url != "http://127.0.0.1:8765"
        with DagsterInstance.ephemeral() as instance:
            result = defs.resolve_job_def("cost_only").execute_in_process(instance=instance, run_id=RUN_2)
            tags = instance.get_run_by_id(RUN_2).tags
        assert result.success
        md = result.asset_materializations_for_node("demo__campaign_cost")[0].metadata
        assert md["dashboard"].value == f"{url}/demo.html" and md["team_dashboard"].value == f"{url}/index.html"
        page = httpx.get(md["dashboard"].value, timeout=30)  # the link opens what campaign_cost just wrote
        assert page.status_code == 200 and "<title>Cost dashboard · demo</title>" in page.text
    with served_here(root) as again:  # without --port: where it served last, so those links open again
        assert again == url and httpx.get(md["team_dashboard"].value, timeout=30).status_code == 200
    # the runs list shows the result first: Dagster orders a run's tags by key, capitalized before lowercase
    assert tags["Verdict"] == "GO" and tags["Cost"] == "$0.012"
    assert [k for k in tags if not k.startswith(("dagster/", ".dagster/"))][:2] == ["Cost", "Verdict"], tags
    total = 0.0010 + 0.0100 + 0.0012  # the teacher's output reused from run-1 is part of this result's cost
    assert md["total_usd"].value == pytest.approx(total)
    assert md["spent_this_run_usd"].value == pytest.approx(0.0112)
    assert md["usd_per_million_teacher_tokens"].value == pytest.approx(0.0010 / 0.05)
    assert md["usd_per_1k_accepted_examples"].value == pytest.approx(0.0010 / 1.6)
    assert md["teacher_tokens"].value == 50_000 and md["accepted_examples"].value == 1600  # counts: integers
    assert isinstance(md["teacher_tokens"].value, int) and isinstance(md["accepted_examples"].value, int)
    assert md["gain_points"].value == pytest.approx(90.0)
    assert md["usd_per_point_gained_lcb"].value == pytest.approx(total / md["gain_points_low"].value, rel=1e-3)
    # for people: the result in one line, numbers rounded (the report file keeps the raw values)
    assert md["result"].value == "GO · cipher 90.0% (base 0.0%) · result $0.012 · spent in this run $0.011"
    assert md["budget_used_fraction"].value == 0.0257 and len(repr(md["gain_points_low"].value)) <= 8
    assert md["plan_total_usd"].value > 0 and md["budget_used_fraction"].value == pytest.approx(
        0.0257
    )  # all spend of both runs
    assert (root / "dashboards" / "demo.html").exists() and (root / "dashboards" / "index.html").exists()
    dash = Path(md["dashboard_file"].value)
    assert dash.exists() and [r["run_id"] for r in ledger.reports("demo")] == ["run-1", RUN_2]

    summary = campaign_summary(root, "demo", "cipher", run_id=RUN_2, spec=spec)
    assert summary["cost"]["run_id"] == RUN_2 and summary["verdict"] == "GO"
    print_summary(blocked | {"run_id": "run-1"}, 1.0)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("dashboard: ")  # the run's summary ends with its cost
    assert "per point gained: not meaningful (gain +4.0 points" in out and "spent in this run: $0.014500" in out

    from campaign_app.cli import main

    assert main(["costs", "demo", "--artifacts", str(root)]) == 0
    out = capsys.readouterr().out
    assert "campaign demo: $0.025700 in 2 run(s)" in out and "run-1" in out
    assert (
        main(
            [
                "costs",
                "--artifacts",
                str(root),
                "--sql",
                "SELECT kind, round(SUM(usd), 6) AS usd FROM cost_lines GROUP BY kind ORDER BY kind",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        "kind\tusd",
        "evaluation\t0.0027",
        "teacher\t0.001",
        "training\t0.022",
    ]
    assert main(["dashboard", "demo", "--artifacts", str(root)]) == 0
    assert capsys.readouterr().out.strip() == str(dash)

    shot = tmp_path / "dashboard.png"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.goto(dash.as_uri())
            text = page.inner_text("body")
            page.screenshot(path=str(shot), full_page=True)
            marks = page.locator("svg circle").count()
            bars = page.locator("svg rect").count()
            box = page.locator("svg").first.bounding_box()
        finally:
            browser.close()
    for needle in (
        "Cost dashboard · campaign demo",
        "$0.012",  # latest result cost, in dollars for people
        "$0.02",  # $/M teacher tokens
        "not meaningful",  # run-1's $/point
        "$0.026 spent of $1.00",  # budget burn: all spend in the ledger
        "run-1"[:8],
        "NO-GO",
        "GO",
    ):
        assert needle in text, needle
    assert marks >= 6 and bars >= 4 and box["width"] > 300 and box["height"] > 100
    pixels = _png_pixels(shot)
    assert shot.stat().st_size > 20_000 and len(set(pixels[::7])) > 30  # a real picture, not a blank page


def _png_pixels(path: Path) -> bytes:
    """The decompressed image data of a PNG (enough to see that the screenshot is not blank)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    i, idat = 8, b""
    while i < len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        kind = data[i + 4 : i + 8]
        if kind == b"IDAT":
            idat += data[i + 8 : i + 8 + n]
        i += 12 + n
    return zlib.decompress(idat)
