"""lm_eval suites that name tasks of the harness's own task library (``tasks: [arc_easy]``, no
``include_path``), offline.

- the registry's ``arc_easy`` (its YAML unchanged, from ``lm_eval/tasks/arc``) runs through the
  project's harness path on the demo student, its dataset read from a local Hugging Face datasets
  cache that this test writes (small ARC-schema rows, laid out as ``datasets.load_dataset`` leaves
  them in ``$HF_HOME/datasets`` on a connected machine: what a user copies to an offline machine);
- a registry task whose dataset is not in the local cache is refused before any model loads, with
  a message naming the dataset and how to pre-download it; a suite mixing its include_path's tasks
  with registry tasks resolves both;
- the worker's cached index of the registry is the index lm_eval builds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from campaigns.spec import LmEvalSpec
from evaluation.harness import HarnessError, HarnessModel, HarnessSuite, evaluate_suites, registry_sha256, task_dir
from tests.support.harness_support import TASKS

pytestmark = pytest.mark.stage

ARC = {  # (question, choices, answer key): the ARC schema (id, question, choices {text, label}, answerKey)
    "train": [("Which is a metal?", ["wood", "iron", "glass", "paper"], "B")],
    "test": [
        ("What do plants need to grow?", ["light", "sand", "noise", "plastic"], "A"),
        ("Which is the closest star to Earth?", ["Sirius", "Vega", "the Sun", "Polaris"], "C"),
        ("What state is ice?", ["gas", "liquid", "plasma", "solid"], "D"),
        ("Which animal lays eggs?", ["hen", "cow", "horse", "dog"], "A"),
        ("What melts snow?", ["cold", "heat", "wind", "night"], "B"),
        ("Which tool measures temperature?", ["ruler", "scale", "thermometer", "clock"], "C"),
    ],
}
ARC["validation"] = ARC["test"][:2]


def arc_rows(split: str) -> list[dict]:
    return [
        {"id": f"{split}-{i}", "question": q, "choices": {"text": c, "label": ["A", "B", "C", "D"]}, "answerKey": k}
        for i, (q, c, k) in enumerate(ARC[split])
    ]


def write_cached_dataset(hf_home: Path, repo_id: str, config: str, splits: dict[str, list[dict]]) -> Path:
    """Put ``splits`` in ``hf_home``'s datasets cache where offline ``datasets.load_dataset(repo_id, config)``
    finds it (``<namespace>___<name>/<config>/<version>/<hash>/``: arrow files named ``<name>-<split>``
    and a dataset_info.json of that config), built by the json builder from local files."""
    from datasets.packaged_modules.json.json import Json

    src = hf_home / "sources"
    src.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(src / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    namespace, name = repo_id.split("/")
    builder = Json(cache_dir=str(hf_home / "build"), dataset_name=name, data_files=files)
    builder.download_and_prepare()
    dest = hf_home / "datasets" / f"{namespace}___{name}" / config / "0.0.0" / "0123456789abcdef"
    shutil.copytree(builder.cache_dir, dest)
    info = json.loads((dest / "dataset_info.json").read_text())
    (dest / "dataset_info.json").write_text(json.dumps({**info, "config_name": config}))
    shutil.rmtree(hf_home / "build")
    return dest


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face home for the harness process (it runs offline)."""
    home = tmp_path / "hf"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return home


@pytest.fixture(scope="module")
def registry_cache(demo_models_root) -> Path:
    return demo_models_root / "_lm_eval_tasks" / "_registry"  # where a campaign on this artifact root keeps it


def _registry_suite(name: str, registry_cache: Path, **settings) -> HarnessSuite:
    spec = LmEvalSpec(**settings)
    assert spec.include_path is None
    return HarnessSuite(name, spec.model_dump(), None, registry_sha256(), 16, registry_cache)


def test_a_registry_task_runs_offline_from_the_local_datasets_cache(tmp_path, hf_home, demo_models, registry_cache):
    write_cached_dataset(hf_home, "allenai/ai2_arc", "ARC-Easy", {s: arc_rows(s) for s in ARC})
    suite = _registry_suite("arc", registry_cache, tasks=["arc_easy"])
    run = evaluate_suites(
        [suite], [HarnessModel("base", str(demo_models["student"]))], tmp_path / "work", log=lambda _m: None
    )

    meta = run.tasks["arc"]["arc_easy"]
    assert meta["config_source"].endswith("lm_eval/tasks/arc/arc_easy.yaml")  # the library's own YAML
    assert (meta["output_type"], meta["metric"], meta["documents"]) == ("multiple_choice", "acc", 6)
    raw = json.loads((tmp_path / "work" / "harness_out.json").read_text())["suites"]["arc"]
    samples = {s["doc_id"]: s for s in raw["runs"]["base"]["samples"]["arc_easy"]}
    assert sorted(samples) == list(range(6))
    for i, (q, choices, key) in enumerate(ARC["test"]):  # the test split, rendered by the library's prompt
        s = samples[i]
        assert s["prompt"] == f"Question: {q}\nAnswer:"
        assert s["reference"] == choices["ABCD".index(key)]
        assert s["choice"] == max(range(4), key=s["loglikelihoods"].__getitem__)
        assert s["score"] == float(s["choice"] == "ABCD".index(key))
    (agreement,) = run.agreement
    assert agreement.agrees and agreement.documents == 6 and agreement.task == "arc_easy"
    assert [r["item_id"] for r in run.rows] == [f"arc_easy/{i}" for i in range(6)]
    assert list(registry_cache.glob("registry-*.pickle"))  # the index is kept for the next process


def test_a_registry_task_without_its_cached_dataset_is_refused_before_any_model(
    tmp_path, hf_home, demo_models, registry_cache
):
    """No dataset in the local cache (offline): refused in the preflight, naming each dataset and how to
    fetch it; a suite with an include_path resolves its own tasks and the library's side by side."""
    mixed = LmEvalSpec(tasks=["cipher_mc", "arc_easy"], include_path=str(TASKS))
    d, sha = task_dir(mixed.include_path, TASKS.parent, tmp_path / "tasks")
    suites = [
        _registry_suite("library", registry_cache, tasks=["arc_challenge", "hellaswag"]),
        HarnessSuite("mixed", mixed.model_dump(), d, sha, 16, registry_cache),
    ]
    with pytest.raises(HarnessError) as e:
        evaluate_suites(suites, [HarnessModel("base", str(demo_models["student"]))], tmp_path / "work")
    err = e.value
    assert err.models_loaded == []  # nothing was loaded
    by_task = {t: [p for p in err.problems if f"task {t!r}" in p] for t in ("arc_challenge", "hellaswag", "arc_easy")}
    assert len(err.problems) == 3 and all(len(v) == 1 for v in by_task.values()), err.problems
    arc = by_task["arc_challenge"][0]
    assert arc.startswith(
        "suite library: task 'arc_challenge' (lm_eval/tasks/arc/arc_challenge.yaml): its dataset "
        "'allenai/ai2_arc' (config 'ARC-Challenge') is not in the local Hugging Face datasets cache "
        f"({hf_home / 'datasets'})"
    ), arc
    assert "datasets.load_dataset('allenai/ai2_arc', 'ARC-Challenge')" in arc and "copy that directory" in arc
    assert "huggingface-cli download --repo-type dataset allenai/ai2_arc" in arc
    assert "datasets.load_dataset('Rowan/hellaswag')" in by_task["hellaswag"][0]
    assert by_task["arc_easy"][0].startswith("suite mixed: task 'arc_easy' (lm_eval/tasks/arc/arc_easy.yaml)")
    assert not any("cipher_mc" in p for p in err.problems)  # the include_path's own task is fine


def test_the_cached_registry_index_is_lm_evals(tmp_path, monkeypatch):
    """On a part of the library (ARC and HellaSwag; the whole one takes ~5 s to index): the cached index
    reads back as lm_eval built it, and a damaged cache is rebuilt."""
    from lm_eval.tasks._index import TaskIndex

    from evaluation.harness_worker import _registry_dir, registry_index

    library = tmp_path / "tasks"
    for d in ("arc", "hellaswag"):
        shutil.copytree(_registry_dir() / d, library / d)
    built = registry_index(str(tmp_path / "cache"), library)  # no cache yet: built by lm_eval's TaskIndex
    (cached,) = (tmp_path / "cache").glob("registry-*.pickle")
    again = registry_index(str(tmp_path / "cache"), library)  # read back
    assert {k: (e.kind, e.yaml_path, e.tags) for k, e in again.items()} == {
        k: (e.kind, e.yaml_path, e.tags) for k, e in built.items()
    }
    assert {"arc_easy", "arc_challenge", "hellaswag", "ai2_arc"} <= set(again)
    assert again["ai2_arc"].tags >= {"arc_easy", "arc_challenge"}
    cached.write_bytes(b"torn")  # a damaged cache is rebuilt, not trusted
    monkeypatch.setattr(TaskIndex, "build", staticmethod(lambda paths, **kw: {"rebuilt": built["arc_easy"]}))
    assert list(registry_index(str(tmp_path / "cache"), library)) == ["rebuilt"]
