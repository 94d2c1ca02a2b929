"""Budgets: a stage stopped mid-way keeps its work and its spend; raising the budget resumes it;
the planner's estimate refuses a stage that cannot fit. Driven through Dagster with the real
pricing resource, IO manager and ledger, on a resumable timed stage (evaluation's guard) that
writes one file per chunk (the contract resumable stages follow) and advances a device clock per
chunk; and on the real teacher stage, whose guard is charged only what new generations used."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from dagster import AssetKey, DagsterInstance, Output, asset, materialize

from assets.common import dagster_failures, stage_context
from assets.io_manager import ManifestIOManager
from campaign_orchestrator.costs.budget import BudgetExceeded, BudgetGuard, Limit
from campaign_orchestrator.costs.ledger import Ledger
from campaigns.loader import parse_campaign_text
from resources.pricing import PricingResource
from resources.storage import ArtifactStore
from tests.support import REPO_ROOT

CHUNKS = 10
CHUNK_S = 0.1  # device seconds per chunk; at the $3600/hour override below a chunk costs $0.10


def _spec(budget: float, check_estimates: bool = False):
    return parse_campaign_text(f"""
name: camp
teacher: {{model: "@demo/teacher", hardware: cpu-2vcpu}}
student: {{base_model: "@demo/student"}}
data: {{source: campaigns/data/demo/*.jsonl}}
training: {{max_steps: 10, hardware: cpu-2vcpu}}
evaluation: {{suites: [{{name: s}}]}}
cost: {{budget_usd: {budget}, check_estimates: {str(check_estimates).lower()}, overrides: {{cpu-2vcpu: 3600}}}}
""")


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Progress:
    def __init__(self, total: int):
        self.total, self.done = total, 0

    def __call__(self, n: int) -> None:
        self.done += n


def _stage(spec, computed: list[int]):
    @asset(key=AssetKey([spec.name, "evaluation"]))
    def evaluation(context, storage: ArtifactStore, pricing: PricingResource):
        with dagster_failures():
            return _work(context, storage, pricing)

    def _work(context, storage, pricing):
        sd = storage.stage(spec.name, "evaluation", "k1")
        if not sd.is_complete():
            out = sd.ensure()
            todo = [i for i in range(CHUNKS) if not (out / f"part-{i}.txt").exists()]
            clock = _Clock()
            guard = pricing.service().guard(stage_context(context, storage, pricing), spec, sd, clock=clock)
            progress = guard.watch(_Progress(len(todo)))
            for i in todo:
                (out / f"part-{i}.txt").write_text(f"chunk {i}")  # the work, kept as it finishes
                computed.append(i)
                clock.t += CHUNK_S
                progress(1)
            lines = pricing.service().bill(spec, "evaluation", {"seconds": clock.t})["lines"]
            sd.commit({"cost_lines": lines, "chunks": CHUNKS, "wall_seconds": clock.t})
        return Output(sd.manifest())

    return evaluation


def _run(spec, root, computed, instance):
    resources = {
        "storage": ArtifactStore(root=str(root)),
        "pricing": PricingResource(),
        "io_manager": ManifestIOManager(root=str(root)),
    }
    return materialize([_stage(spec, computed)], instance=instance, resources=resources, raise_on_error=False)


def _failure(result) -> str:
    return next(e.event_specific_data.error.message for e in result.all_events if e.is_step_failure)


def test_budget_stops_a_stage_midway_and_a_raised_budget_resumes_it(artifact_root):
    ledger = Ledger(artifact_root / "cost_ledger.duckdb")
    computed: list[int] = []
    with DagsterInstance.ephemeral() as instance:
        stopped = _run(_spec(0.35), artifact_root, computed, instance)
        assert not stopped.success
        msg = _failure(stopped)
        # after 3 chunks ($0.30) one more ($0.10) would pass $0.35: stop, keep the 3 chunks
        assert computed == [0, 1, 2]
        assert "stopped evaluation mid-way" in msg and "spent $0.300000 of its $0.350000 budget" in msg
        assert "$0.050000 remains" in msg and "raise the budget" in msg
        parts = sorted(p.name for p in (artifact_root / "camp/evaluation/k1").glob("part-*"))
        assert parts == ["part-0.txt", "part-1.txt", "part-2.txt"]
        assert ledger.spent("camp") == pytest.approx(0.30)
        assert ledger.query("SELECT DISTINCT status FROM cost_lines") == [{"status": "interrupted"}]

        resumed = _run(_spec(1.05), artifact_root, computed, instance)
    assert resumed.success
    assert computed == list(range(CHUNKS))  # each chunk computed once in all
    runs = {r["run_id"]: r for r in ledger.runs("camp")}
    assert runs[stopped.run_id]["interrupted_usd"] == pytest.approx(0.30)
    assert runs[resumed.run_id]["evaluation_usd"] == pytest.approx(0.70)
    assert ledger.spent("camp") == pytest.approx(1.00)  # within the raised $1.05
    # the result's cost includes the stopped attempt's spend on the same output
    assert sum(x["usd"] for x in ledger.lineage_lines("camp", {"evaluation": "k1"})) == pytest.approx(1.0)


def test_the_planner_estimate_refuses_a_stage_that_cannot_fit(artifact_root):
    computed: list[int] = []
    with DagsterInstance.ephemeral() as instance:
        result = _run(_spec(1.0, check_estimates=True), artifact_root, computed, instance)
    assert not result.success and computed == []
    msg = _failure(result)
    assert "not starting evaluation" in msg and "the planner estimates $" in msg
    assert Ledger(artifact_root / "cost_ledger.duckdb").spent("camp") == 0.0


def test_guard_stage_budget_and_the_last_chunk(tmp_path):
    """A stage budget applies next to the campaign's; the final chunk is not charged for a next one."""
    clock = _Clock()
    guard = BudgetGuard(
        ledger=Ledger(tmp_path / "l.duckdb"),
        campaign="c",
        stage="evaluation",
        run_id="r",
        step_key="s",
        attempt=0,
        stage_key="k",
        limits=[Limit("campaign c", 10.0, 0.0), Limit("stage evaluation", 0.5, 0.2)],
        line_fn=lambda s, n: [
            {"kind": "evaluation", "price_key": "x", "quantity": s, "unit": "host-hour", "unit_price": 1.0, "usd": s}
        ],
        clock=clock,
    )
    progress = guard.watch(_Progress(3))
    clock.t = 0.1
    progress(1)
    clock.t = 0.2
    progress(1)
    clock.t = 0.3
    progress(1)  # 0.2 + 0.3 = 0.5: at the limit, and the work is done: no stop
    assert not guard.stopped
    clock.t = 0.4
    with pytest.raises(BudgetExceeded) as e:
        guard.check()
    assert e.value.scope == "stage evaluation" and e.value.remaining_usd == 0.0
    with pytest.raises(BudgetExceeded, match="not starting evaluation"):
        guard.check_estimate(0.4, already_spent_on_it_usd=0.05)
    guard.check_estimate(0.35, already_spent_on_it_usd=0.1)  # the resumed part fits


def test_the_teacher_stage_stops_midway_on_its_budget(artifact_root):
    """The real teacher_generations asset with an API teacher (backend openai, the project's test server)
    priced by `teacher.price` (api-open-70b, $0.88 per million tokens): the one price field the ledger,
    the planner and the guard all read. The spend accrues per answered prompt, so the stop is
    deterministic: with a $0.004 budget the stage stops part-way, when the next answer would pass $0.004,
    within one chunk (one answer) of the limit; the spend of the stopped attempt is in the ledger and
    the server stops being asked."""
    import yaml

    from assets import prompts
    from assets import teacher_generations as generations
    from assets.location import default_resources
    from tests.support.testserver import ServerConfig, ServerThread

    d = yaml.safe_load((REPO_ROOT / "campaigns/demo.yaml").read_text())
    with ServerThread(ServerConfig(latency_s=0.02)) as srv:
        d["teacher"] = {
            "backend": "openai",
            "model": "teacher",
            "base_url": srv.base_url,
            "price": "api-open-70b",
            "max_concurrency": 2,
            "sampling": {"max_new_tokens": 16},
        }
        d["cost"] = {"budget_usd": 0.004, "check_estimates": False}
        spec = parse_campaign_text(yaml.safe_dump(d))
        with DagsterInstance.ephemeral() as instance:
            result = materialize(
                [prompts.build(spec), generations.build(spec)],
                instance=instance,
                raise_on_error=False,
                resources=default_resources(str(artifact_root)),
            )
        asked = srv.stats.received
    assert not result.success
    msg = _failure(result)
    assert "stopped teacher_generations mid-way" in msg and "of its $0.004000 budget" in msg
    ledger = Ledger(artifact_root / "cost_ledger.duckdb")
    stopped = ledger.query("SELECT status, resource, usd FROM cost_lines WHERE asset = 'teacher_generations'")
    assert {r["status"] for r in stopped} == {"interrupted"}
    assert sorted(r["resource"] for r in stopped) == ["api-open-70b:input", "api-open-70b:output"]
    spent = sum(r["usd"] for r in stopped)
    per_chunk = float(re.search(r"next chunk would cost about \$([0-9]+\.[0-9]+)", msg).group(1))
    assert 0 < per_chunk < 1e-4 and spent <= 0.004  # a chunk is one answer here
    assert spent + per_chunk > 0.004 - 1e-9  # stopped because the next answer would not fit, not earlier
    assert 0 < asked < 2400 * 0.9 / 4  # it stopped asking: most of the ~2160 training prompts were never sent
    assert not list((artifact_root / "demo" / "teacher_generations").glob("*/_SUCCESS"))


def test_training_launcher_stops_every_process_when_the_budget_says_so(tmp_path):
    """The launcher polls the guard while torchrun runs; a budget stop terminates all nodes."""
    import signal
    import time

    from resources.local_launcher import LocalTorchrunLauncher
    from tests.support.processes import sleeping_node

    procs = [sleeping_node(tmp_path / f"node{i}.out") for i in range(2)]
    clock = _Clock()
    guard = BudgetGuard(
        ledger=Ledger(tmp_path / "l.duckdb"),
        campaign="c",
        stage="student_adapter",
        run_id="r",
        step_key="s",
        attempt=0,
        stage_key="k",
        limits=[Limit("campaign c", 1.0, 0.0)],
        line_fn=lambda s, n: [
            {"kind": "training", "price_key": "x", "quantity": s, "unit": "gpu-hour", "unit_price": 1.0, "usd": s}
        ],
        clock=lambda: clock.t,
    )

    def tick():
        clock.t += 0.3  # each poll: 0.3 device-seconds at $1/s
        guard.check()

    with pytest.raises(BudgetExceeded, match="stopped student_adapter mid-way"):
        LocalTorchrunLauncher._wait(
            procs,
            [tmp_path / "a.log", tmp_path / "b.log"],
            time.monotonic() + 60,
            type("B", (), {"check": staticmethod(tick)})(),
        )
    # every node stopped, not left to its minute: a node that ended by itself exits 0, a stopped one by the signal
    assert all(p.poll() in (-signal.SIGTERM, -signal.SIGKILL) for p in procs), [p.returncode for p in procs]
    assert Ledger(tmp_path / "l.duckdb").spent("c") == pytest.approx(0.9)  # stopped after 3 polls: a 4th passes $1


def test_evaluation_stops_between_models_when_its_spend_passes_the_budget(tmp_path):
    """The evaluation stage's guard watches answer_suites: after the candidate's suite has cost $0.30 of a
    $0.50 budget, one more like it would pass the budget, so the base model is never run."""
    from campaign_orchestrator.demo import cipher
    from evaluation.runner import SuiteRun, answer_suites
    from evaluation.scorers import build_scorer

    @dataclass
    class Answer:
        text: str
        latency_s: float
        error: str | None = None

    clock = _Clock()
    guard = BudgetGuard(
        ledger=Ledger(tmp_path / "l.duckdb"),
        campaign="c",
        stage="evaluation",
        run_id="r",
        step_key="s",
        attempt=0,
        stage_key="k",
        limits=[Limit("campaign c", 0.5, 0.0)],
        line_fn=lambda s, n: [
            {"kind": "evaluation", "price_key": "x", "quantity": s, "unit": "host-hour", "unit_price": 1.0, "usd": s}
        ],
        clock=clock,
    )
    answered = []

    def model(name):  # the cipher itself answers (what the teacher learned); each model costs 0.3 s of clock
        def generate(prompts, max_new_tokens):
            answered.append(name)
            clock.t += 0.3
            return [Answer(cipher.encode(p.split()[1]), 0.0) for p in prompts]

        return lambda: generate

    items = [
        {"id": f"i{k}", "prompt": f"encode {w} =", "reference": cipher.encode(w), "category": "all"}
        for k, w in enumerate(["abc", "hello", "zebra"])
    ]
    with pytest.raises(BudgetExceeded, match="campaign c"):
        answer_suites(
            [SuiteRun("cipher", items, build_scorer("exact_match"), 8)],
            {"candidate": model("candidate"), "base": model("base")},
            log=lambda m: None,
            progress=guard.watch(),
        )
    assert answered == ["candidate"] and guard.stopped
