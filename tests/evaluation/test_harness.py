"""lm_eval suites through the real harness (lm_eval 0.4.13, its own process) on the demo base and
adapters trained here by the project's trainer: the shipped cipher tasks (a generation task and a
multiple-choice task, custom and local).

- the harness's per-document scores equal the project's own scoring of the same items, item by item:
  generation through the project's evaluator (LocalModel + exact_match), multiple choice by an
  independent log-likelihood computation;
- the gate's paired delta and verdict: GO for a good adapter, NO-GO for a broken one (trained on
  another cipher);
- a hub-only metric, a missing task file and a base/candidate prompt mismatch are refused with a clear
  message before any model is loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from campaigns.spec import LmEvalSpec
from evaluation.harness import HarnessError, HarnessModel, HarnessSuite, evaluate_suites, task_dir
from tests.support.harness_support import TASKS, independent_choice_scores, project_generation_scores, train_adapter

pytestmark = pytest.mark.stage


def _suite(tmp: Path, name: str, include: Path, registry_cache: Path | None = None, **settings) -> HarnessSuite:
    spec = LmEvalSpec(include_path=str(include), **{"tasks": ["cipher"], **settings})
    d, sha = task_dir(spec.include_path, include.parent, tmp / "tasks")
    return HarnessSuite(name, spec.model_dump(), d, sha, 16, registry_cache)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, demo_models):
    """A good adapter (the cipher, 80 steps: nearly every answer right), a partial one (66 steps: on the cipher's
    steep slope between 60 steps, about a fifth right, and 74, nearly all; some answers right and some wrong, so
    item-by-item agreement is not trivial) and a broken one (trained the same way on another substitution, so it
    answers confidently wrong)."""
    from campaign_orchestrator.demo import cipher

    root = tmp_path_factory.mktemp("adapters")
    base = demo_models["student"]
    return {
        "good": train_adapter(root / "good", base, steps=80),
        "partial": train_adapter(root / "partial", base, steps=66),
        "broken": train_adapter(root / "broken", base, steps=40, examples=600, mapping=cipher.cipher_map(seed=8)),
    }


@pytest.fixture(scope="module")
def harness_run(tmp_path_factory, demo_models, adapters):
    tmp = tmp_path_factory.mktemp("harness")
    base = str(demo_models["student"])
    models = [
        HarnessModel("base", base, None, True, "bfloat16"),
        HarnessModel("candidate", base, str(adapters["good"]), True, "bfloat16"),
        HarnessModel("partial", base, str(adapters["partial"]), True, "bfloat16"),
        HarnessModel("broken", base, str(adapters["broken"]), True, "bfloat16"),
    ]
    events = []
    run = evaluate_suites(
        [_suite(tmp, "harness_cipher", TASKS)],
        models,
        tmp / "work",
        log=events.append,
        progress=lambda n: events.append(n),
    )
    raw = json.loads((tmp / "work" / "harness_out.json").read_text())["suites"]["harness_cipher"]
    return run, raw, events


def _rows(run, role: str, task: str) -> dict[str, dict]:
    return {r["item_id"]: r for r in run.rows if r["model"] == role and r["item_id"].startswith(task + "/")}


def test_harness_scores_equal_the_projects_own_item_by_item(harness_run, demo_models, adapters):
    run, raw, events = harness_run
    assert events.count(120) == 4, events  # one progress tick per model: 60 + 60 documents each
    base = demo_models["student"]
    figures = {}
    for role, adapter in (("base", None), ("candidate", adapters["good"]), ("partial", adapters["partial"])):
        gen = project_generation_scores(base, adapter)
        h = _rows(run, role, "cipher_gen")
        assert set(h) == set(gen) and len(gen) == 60
        assert {k: v["score"] for k, v in h.items()} == {k: s for k, (s, _) in gen.items()}, role
        assert {k: v["output"] for k, v in h.items()} == {k: o.strip() for k, (_, o) in gen.items()}, role

        mc = independent_choice_scores(base, adapter)
        samples = {f"cipher_mc/{s['doc_id']}": s for s in raw["runs"][role]["samples"]["cipher_mc"]}
        assert {k: s["score"] for k, s in samples.items()} == {k: v[0] for k, v in mc.items()}, role
        assert {k: s["choice"] for k, s in samples.items()} == {k: v[1] for k, v in mc.items()}, role
        gap = max(abs(a - b) for k, v in mc.items() for a, b in zip(v[2], samples[k]["loglikelihoods"], strict=True))
        assert gap < 0.5, gap  # bf16 compute, other batching: the same numbers to a fraction of a nat
        figures[role] = {
            "cipher_gen": sum(s for s, _ in gen.values()) / 60,
            "cipher_mc": sum(v[0] for v in mc.values()) / 60,
        }

    # the harness's aggregate is shown beside the project's mean, and they agree
    table = {(a.task, a.role): a for a in run.agreement}
    for role, by_task in figures.items():
        for task, project in by_task.items():
            a = table[(task, role)]
            assert a.agrees and a.documents == 60
            assert a.harness == pytest.approx(project, abs=1e-12) and a.project == pytest.approx(project, abs=1e-12)
    assert figures["base"] == {"cipher_gen": 0.0, "cipher_mc": 0.0}  # the base copies the word
    assert figures["candidate"]["cipher_gen"] > 0.5
    assert 0.0 < figures["partial"]["cipher_gen"] < 1.0  # right and wrong answers: agreement is not trivial
    print("agreement (harness == project):", json.dumps(figures))


def test_gate_judges_harness_suites_paired(harness_run):
    from evaluation.gate import BREACH, GO, NO_GO, GatePolicy, StatsPolicy, decide

    run, _, _ = harness_run
    by = {}
    for r in run.rows:
        by.setdefault(r["model"], []).append(r)
    from evaluation.gate import ItemResult

    items = {
        role: [
            ItemResult(
                r["item_id"],
                r["category"],
                r["output"],
                r["score"],
                r["latency_s"],
                r["error"],
                r["prompt"],
                r["reference"],
            )
            for r in rows
        ]
        for role, rows in by.items()
    }
    policy = GatePolicy(
        min_score=0.8, max_regression_vs_base=0.03, max_category_regression=0.05, min_category_items=20, min_items=50
    )
    sp = StatsPolicy(resamples=2000)
    good = decide("harness_cipher", items["candidate"], items["base"], policy, sp)
    bad = decide("harness_cipher", items["broken"], items["base"], policy, sp)

    for rep, role in ((good, "candidate"), (bad, "broken")):
        base = {r.item_id: r.score for r in items["base"]}
        cand = {r.item_id: r.score for r in items[role]}
        assert rep.overall.n == 120 and set(c.category for c in rep.categories) == {"cipher_gen", "cipher_mc"}
        assert rep.overall.delta.estimate == pytest.approx(sum(cand[k] - base[k] for k in base) / 120, abs=1e-12)
        for c in rep.categories:  # per subtask, the same paired difference on that task's documents
            keys = [k for k in base if k.startswith(c.category + "/")]
            assert c.n == 60
            assert c.delta.estimate == pytest.approx(sum(cand[k] - base[k] for k in keys) / 60, abs=1e-12)
        assert rep.binary and rep.overall.mcnemar_p is not None
    assert good.verdict == GO, good.reasons
    assert good.overall.delta.lo > 0.5
    assert bad.verdict == NO_GO
    rules = {r.rule: r for r in bad.rules}
    assert rules["min_score"].status == BREACH and rules["min_score"].value < 0.1, rules["min_score"]
    print(
        "gate:",
        {
            name: {
                "verdict": r.verdict,
                "delta": round(r.overall.delta.estimate, 4),
                "ci": [round(r.overall.delta.lo, 4), round(r.overall.delta.hi, 4)],
                "candidate": round(r.candidate.score, 4),
                "mcnemar_p": r.overall.mcnemar_p,
                "categories": {c.category: round(c.delta.estimate, 4) for c in r.categories},
            }
            for name, r in (("good", good), ("broken", bad))
        },
    )


def test_preflight_refuses_hub_metrics_missing_task_files_and_prompt_mismatches(
    tmp_path, demo_models, demo_models_root
):
    """Three broken suites in one harness call: every problem is reported, no model is loaded."""
    from transformers import AutoTokenizer

    from tests.support.dataprep_support import CHAT
    from tests.support.eval_support import make_zero_adapter

    hub = tmp_path / "hub"
    shutil.copytree(TASKS, hub)
    gen = (hub / "cipher_gen.yaml").read_text()
    (hub / "cipher_gen.yaml").write_text(gen.replace("metric: exact_match", "metric: bertscore"))
    mc = (hub / "cipher_mc.yaml").read_text()
    (hub / "cipher_mc.yaml").write_text(mc.replace("  - metric: acc\n", "  - metric: acc\n    hf_evaluate: true\n"))

    missing = tmp_path / "missing"
    shutil.copytree(TASKS, missing)
    (missing / "_cipher_common.yaml").unlink()  # both tasks `include:` it

    # the candidate's adapter carries a tokenizer whose chat template differs from the base's
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    for f in demo_models["student"].iterdir():
        (base_dir / f.name).symlink_to(f)
    (base_dir / "tokenizer_config.json").unlink()
    (base_dir / "tokenizer.json").unlink()
    tok = AutoTokenizer.from_pretrained(str(demo_models["student"]))
    tok.chat_template = CHAT
    tok.save_pretrained(str(base_dir))
    adapter = make_zero_adapter(demo_models["student"], tmp_path / "adapter")
    tok.chat_template = CHAT.replace("assistant =", "answer:")
    tok.save_pretrained(str(adapter))

    # cipher_gen is then not in its include_path, so it is looked up in the harness's task library too
    registry = demo_models_root / "_lm_eval_tasks" / "_registry"
    suites = [
        _suite(tmp_path, "hub_metric", hub),
        _suite(tmp_path, "no_file", missing, registry, tasks=["cipher_gen"]),
        _suite(tmp_path, "chat", TASKS, tasks=["cipher_mc"], apply_chat_template=True),
    ]
    models = [HarnessModel("base", str(base_dir)), HarnessModel("candidate", str(base_dir), str(adapter))]
    with pytest.raises(HarnessError) as e:
        evaluate_suites(suites, models, tmp_path / "work")
    err = e.value
    assert err.models_loaded == []  # refused before any model was loaded
    text = str(err)
    assert text.startswith("lm_eval suite refused before any model ran")
    p = {s: [x for x in err.problems if x.startswith(f"suite {s}:")] for s in ("hub_metric", "no_file", "chat")}
    assert any(
        "metric 'bertscore' is not a built-in lm_eval metric" in x and "hub" in x and "cipher_gen" in x
        for x in p["hub_metric"]
    ), p
    assert any("metric 'acc' has `hf_evaluate: true`" in x and "cipher_mc" in x for x in p["hub_metric"]), p
    assert len(p["no_file"]) == 1 and "task 'cipher_gen' is not defined by any YAML file" in p["no_file"][0]
    assert "nor the harness's task registry (lm_eval 0.4.13" in p["no_file"][0]
    assert "cipher_gen.yaml: FileNotFoundError" in p["no_file"][0] and "_cipher_common.yaml" in p["no_file"][0]
    assert len(p["chat"]) == 1 and "prompt hash mismatch" in p["chat"][0]
    assert "60 of 60 documents" in p["chat"][0] and "assistant =" in p["chat"][0] and "answer:" in p["chat"][0]


def test_a_budget_stop_while_the_harness_runs_stops_its_process(tmp_path, demo_models):
    """The evaluation's budget watch is called from the harness's progress events; when it raises, the
    harness process is killed and the stop propagates (nothing is written as a result)."""
    from evaluation.harness import _job, run_worker

    class BudgetStop(Exception):
        pass

    def watch(ev):
        if ev["event"] == "model_loaded":
            raise BudgetStop("budget exceeded")

    job = _job(
        "evaluate",
        [_suite(tmp_path, "s", TASKS, tasks=["cipher_gen"], limit=5)],
        [HarnessModel("base", str(demo_models["student"]))],
        threads=1,
    )
    with pytest.raises(BudgetStop):
        run_worker(job, tmp_path / "work", log=lambda _m: None, on_event=watch)
    assert not (tmp_path / "work" / "harness_out.json").exists()
