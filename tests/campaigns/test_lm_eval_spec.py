"""``kind: lm_eval`` suites and ``data.decontamination`` in the campaign spec; the shipped harness task files."""

import pytest
import yaml

from campaigns.loader import CampaignError, parse_campaign_text
from tests.support import REPO_ROOT as REPO

DEMO = (REPO / "campaigns" / "demo.yaml").read_text()


def _with(mutate) -> str:
    data = yaml.safe_load(DEMO)
    mutate(data)
    return yaml.safe_dump(data, sort_keys=False)


def _problems(text: str) -> str:
    with pytest.raises(CampaignError) as e:
        parse_campaign_text(text, "campaigns/bad.yaml")
    return str(e.value)


def _harness(data) -> dict:
    return next(s for s in data["evaluation"]["suites"] if s.get("kind") == "lm_eval")


def test_the_demo_gates_on_a_harness_suite_and_decontaminates():
    spec = parse_campaign_text(DEMO, "campaigns/demo.yaml")
    s = next(x for x in spec.evaluation.suites if x.kind == "lm_eval")
    assert s.lm_eval.tasks == ["cipher"] and s.tier == "blocking"
    assert spec.path(s.lm_eval.include_path).joinpath("cipher.yaml").is_file()
    assert spec.data.decontamination.action == "drop" and spec.data.decontamination.ngram == 13
    assert next(x for x in spec.evaluation.suites if x.kind == "items").lm_eval is None


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda s: s.pop("lm_eval"), "kind 'lm_eval' needs `lm_eval`"),
        (
            lambda s: s.update(scorer="exact_match", max_new_tokens=8),
            "['max_new_tokens', 'scorer'] are not used by kind 'lm_eval'",
        ),
        (lambda s: s.update(kind="items"), "`lm_eval` is set but kind is 'items'"),
        (lambda s: s["lm_eval"].update(tasks=[]), "tasks"),
        (lambda s: s["lm_eval"].update(tasks=["cipher", "cipher"]), "task names must be unique"),
        (lambda s: s["lm_eval"].update(include_path="s3://"), "expected s3://bucket"),
        (lambda s: s["lm_eval"].update(limit=0), "limit"),
        (lambda s: s["lm_eval"].update(num_fewshots=5), "num_fewshots"),
    ],
)
def test_bad_lm_eval_suites_are_named(mutate, expected):
    msg = _problems(_with(lambda d: mutate(_harness(d))))
    assert expected in msg, msg
    assert "campaigns/bad.yaml:" in msg and "evaluation.suites[2]" in msg, msg


def test_bad_decontamination_settings_are_named():
    msg = _problems(_with(lambda d: d["data"]["decontamination"].update(action="warn")))
    assert "data.decontamination.action" in msg and "'drop', 'fail' or 'off'" in msg, msg


def test_shipped_task_files_are_what_the_demo_module_writes():
    """campaigns/lm_eval_tasks/cipher is the output of campaign_orchestrator.demo.lm_eval_task (not hand-edited)."""
    from campaign_orchestrator.demo import cipher, lm_eval_task

    shipped = REPO / "campaigns" / "lm_eval_tasks" / "cipher"
    assert {p.name: p.read_text() for p in shipped.iterdir() if p.is_file()} == lm_eval_task.files()
    for d in lm_eval_task.mc_docs():
        word = d["prompt"].removeprefix("encode ").removesuffix(" =")
        assert d["choices"][d["label"]] == cipher.encode(word) and len(set(d["choices"])) == 4
        assert word in d["choices"] or cipher.encode(word) == word  # the copy is one of the wrong choices
    assert all(g["answer"] == cipher.encode(g["prompt"].split()[1]) for g in lm_eval_task.gen_docs())


def test_a_suite_of_the_harness_task_library_needs_no_include_path(tmp_path):
    """`tasks: [arc_easy, hellaswag]` alone: the harness's own tasks, no task directory to copy; its
    identity is the installed lm_eval (whose registry defines them)."""
    from evaluation.harness import registry_sha256
    from resources.storage import ArtifactStore
    from stages.harness import TASKS_DIR, harness_identity, harness_suites

    def library(d):
        s = _harness(d)
        s["lm_eval"] = {"tasks": ["arc_easy", "hellaswag"], "limit": 50}

    spec = parse_campaign_text(_with(library), "campaigns/demo.yaml")
    x = next(s for s in spec.evaluation.suites if s.kind == "lm_eval")
    assert x.lm_eval.include_path is None and x.lm_eval.tasks == ["arc_easy", "hellaswag"]
    (suite,) = harness_suites(spec, ArtifactStore(root=str(tmp_path)))
    assert suite.task_dir is None and suite.tasks_sha256 == registry_sha256()
    assert suite.registry_cache == tmp_path / TASKS_DIR / "_registry"
    assert not (tmp_path / TASKS_DIR).exists() or not any((tmp_path / TASKS_DIR).iterdir())  # nothing copied
    assert harness_identity(x, [suite])["tasks_sha256"] == registry_sha256()

    shipped = parse_campaign_text(DEMO, "campaigns/demo.yaml")  # an include_path suite: its directory's hash
    (own,) = harness_suites(shipped, ArtifactStore(root=str(tmp_path)))
    assert own.task_dir is not None and own.tasks_sha256 != registry_sha256()
