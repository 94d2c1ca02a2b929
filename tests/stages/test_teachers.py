"""Several teachers in the teacher stage, on real tiny data (issue 45): the demo cipher teacher answering a few dozen
prompts as two teachers routed by category (``short`` first, then the default ``general``), without Dagster. A
changed teacher or a moved category re-asks only its rows; a teacher over its ``budget_share`` is stopped mid-way
and the other goes on (the stage commits every finished row, each naming its teacher, and the cost lines and the
cost report say who spent what and who was stopped); on Ray each teacher's prompts are sharded as in process."""

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
    between batches, at most 12 tokens) and the default ``general`` (16 tokens): two identities, two caches (the
    same model asked the same way would be one: an identical request is never paid for twice)."""
    return [
        demo_teacher()
        | {"name": "short", "categories": ["short"], "batch_size": 4, "sampling": {"max_new_tokens": 12}}
        | (short or {}),
        demo_teacher() | {"name": "general"},
    ]


def _stage(tmp_path, project: str, teacher: list[dict], prompts_n: int = 40, **sections):
    """The prompts and teacher stages of a shrunk demo campaign with ``teacher`` (a list), in ``project`` under
    ``tmp_path`` with its own artifact root (the demo models linked from ``tmp_path/models``); ``(manifest, rows by
    id, the training prompts)``."""
    from stages import prompts, teacher_generations

    spec = load_campaign_file(write_campaign(tmp_path / project, "routed", teacher, prompts=prompts_n, **sections))
    root = tmp_path / "artifacts"
    ctx = StageContext(store=Store(root=str(root)), run_id=project, log=Lines())
    p = prompts.run(spec, {}, ctx).manifest
    m = teacher_generations.run(spec, {"prompts": p}, ctx).manifest
    rows = {r["id"]: r for r in pq.read_table(m["generations_path"]).to_pylist()}
    return m, rows, pq.read_table(p["train_path"]).to_pylist()


def test_a_changed_teacher_or_a_moved_category_re_asks_only_its_rows(tmp_path, artifact_root):
    """The stage's key holds every teacher's name, categories, identity and sampling; each teacher's generation
    cache keeps its answers, so a rerun asks only what changed. A single teacher's keys are pinned, unchanged, by
    tests/stages/test_content_keys.py."""
    fast = {"batch_size": 64}
    first, _rows, train = _stage(artifact_root.parent, "first", teachers(fast), 80)
    n_short = sum(r["category"] == "short" for r in train)
    n_long = len(train) - n_short
    assert first["teachers"]["short"]["generated"] == n_short and first["teachers"]["general"]["generated"] == n_long

    changed, _rows, _ = _stage(
        artifact_root.parent, "changed", teachers(fast | {"sampling": {"max_new_tokens": 10}}), 80
    )
    assert changed["key"] != first["key"]
    assert changed["teachers"]["short"]["generated"] == n_short  # the changed teacher: asked again
    assert changed["teachers"]["general"]["generated"] == 0  # the other: every answer from its cache
    assert changed["teachers"]["general"]["cache_hits"] == n_long

    moved, rows, _ = _stage(artifact_root.parent, "moved", teachers(fast | {"categories": ["short", "long"]}), 80)
    assert moved["key"] not in (first["key"], changed["key"])
    assert moved["teachers"]["short"]["rows"] == len(train) and moved["teachers"]["general"]["rows"] == 0
    assert moved["teachers"]["short"]["generated"] == n_long  # the moved rows only
    assert moved["teachers"]["short"]["cache_hits"] == n_short
    assert {r["teacher"] for r in rows.values()} == {"short"}


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
    assert "teacher short's budget_share (0.0001% of $1.000000)" in m["stopped_teachers"]["short"]
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


@pytest.mark.heavy  # a local Ray cluster started and stopped: `make test-heavy`
def test_several_teachers_on_ray_answer_as_in_process(tmp_path, artifact_root):
    """The routed teacher stage on a local Ray cluster (one replica): each teacher's prompts as shards of their
    own, every shard done, and the rows those of the same teachers in process (greedy: identical completions)."""
    for project in ("local", "ray"):  # each its own artifact root (own generation cache), the models linked
        (tmp_path / project / "artifacts").mkdir(parents=True)
        (tmp_path / project / "artifacts" / "models").symlink_to(artifact_root / "models")
    local, local_rows, _ = _stage(tmp_path / "local", "local", teachers())
    execution = {"executor": "ray", "replicas": 1, "num_cpus_per_replica": 1, "shard_prompts": 8}
    ray, ray_rows, _ = _stage(tmp_path / "ray", "ray", teachers(), execution=execution)

    assert set(ray["ray_teachers"]) == {"short", "general"}
    for name, r in ray["ray_teachers"].items():
        assert r["shards_done"] == r["shards_total"] >= 2, name
        assert ray["teachers"][name]["generated"] == local["teachers"][name]["generated"] > 0
    assert ray_rows.keys() == local_rows.keys()
    assert all(
        ray_rows[i]["completion"] == r["completion"] and ray_rows[i]["teacher"] == r["teacher"]
        for i, r in local_rows.items()
    )
    assert {x["teacher"] for x in ray["cost_lines"]} == {"short", "general"}


def test_replay_answered_by_the_teachers_routes_each_prompt_by_its_category(tmp_path, artifact_root):
    """``data.replay.answered_by: teacher`` with several teachers: each replay prompt answered by the teacher of its
    category (rows and cost lines naming it); a rerun of the stage asks nothing."""
    import yaml

    from campaign_orchestrator.demo import cipher
    from stages import distillation_set, prompts, teacher_generations

    path = write_campaign(tmp_path / "project", "replayed", teachers({"batch_size": 64}), prompts=40)
    raw = yaml.safe_load(path.read_text())
    replay = tmp_path / "replay.jsonl"
    cipher.write_jsonl(cipher.items(30, seed=3), replay)
    raw["data"]["replay"] = {"source": str(replay), "answered_by": "teacher", "share": 0.25, "max_new_tokens": 8}
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec = load_campaign_file(path)
    ctx = StageContext(store=Store(root=str(artifact_root)), run_id="replay-1", log=Lines())
    p = prompts.run(spec, {}, ctx).manifest
    g = teacher_generations.run(spec, {"prompts": p}, ctx).manifest
    d = distillation_set.run(spec, {"generations": g, "prompts": p}, ctx).manifest

    cat = {f"replay:{r['id']}": r["category"] for r in cipher.items(30, seed=3)}
    rows = [r for r in pq.read_table(d["distillation_path"]).to_pylist() if r["id"].startswith("replay:")]
    assert rows and d["replay"]["answered_by"] == "teacher" and d["replay"]["generated"] == d["replay"]["prompts"]
    assert {cat[r["id"]] for r in rows} == {"short", "long"}  # both teachers had replay prompts
    assert all(r["teacher"] == ("short" if cat[r["id"]] == "short" else "general") for r in rows)
    replay_lines = [x for x in d["cost_lines"] if x.get("teacher")]
    assert {x["teacher"] for x in replay_lines} == {"short", "general"} and all(x["usd"] > 0 for x in replay_lines)

    again = distillation_set.run(spec, {"generations": g, "prompts": p}, ctx)
    assert again.cached


def test_the_plan_prices_each_teacher_over_its_share(artifact_root):
    """`campaign plan` of the shipped two-teacher demo: each teacher over its share of the training prompts and of
    the held-out items at its own price, the teacher stage their sum, and a line per teacher."""
    from campaign_orchestrator.costs.plan.render import render_plan
    from stages.pricing import Pricing
    from tests.support import REPO_ROOT

    spec = load_campaign_file(REPO_ROOT / "campaigns" / "demo_teachers.yaml")
    plan = Pricing().plan(spec, artifact_root)
    t = plan.teachers
    assert set(t) == {"short", "general"}
    assert sum(x["train_share"] for x in t.values()) == pytest.approx(1.0)
    assert sum(x["heldout_share"] for x in t.values()) == pytest.approx(1.0)
    assert 0.3 < t["short"]["train_share"] < 0.7  # the demo's words: about half of them short
    gen = plan.stages["teacher_generations"]
    assert gen.usd == pytest.approx(sum(x["teacher_generations_usd"] for x in t.values())) and gen.usd > 0
    ev = plan.stages["evaluation"]
    assert ev.teacher_usd == pytest.approx(sum(x["scoring_usd"] for x in t.values()))
    assert plan.total_usd == pytest.approx(sum(s.usd for s in plan.stages.values()))
    text = render_plan(plan)
    assert f"teacher short: {t['short']['train_share']:.0%} of the training prompts" in text
    assert "teacher general: " in text
