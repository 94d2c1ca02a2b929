"""The stage move (issue 44) changed no content key: no artifact is rebuilt and nothing is paid again.

``GOLDEN`` holds every stage's content key for the shipped campaigns as the code before the move computed them
(main at 039f5fc, the stages still in ``assets/``), with the same deterministic stand-ins for what is host- or
build-specific: a model's fingerprint (its directory name), the resolved precision (``cpu:float32``) and the
tokenizer hash; the upstream manifests are fixed dicts. ``PROMPTS`` are the prompts stages' keys over the shipped
data files, as that code computed them. The stages compute their keys here as ``run`` does (a store that stops at
the stage directory), so a change to any key's parts fails this test."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from campaigns.loader import load_campaign_file
from stages.context import StageContext
from stages.storage import Store
from tests.support import REPO_ROOT

GOLDEN = {
    "demo": {
        "teacher_generations": "dcfa6c38d48d7995c58d",
        "distillation_set": "fa50e71bd4a2d09891eb",
        "tokenized_dataset": "83e8b55b4496383f7a81",
        "student_adapter": "c7d425c251eb74ca6106",
        "evaluation_items": "1e5a2f36d193a6b6dcf7",
        "evaluation": "f854423a76915ef78981",
        "drift_evaluation": "5e559c961b61ddd01c61",
    },
    "demo_sweep": {
        "teacher_generations": "dcfa6c38d48d7995c58d",
        "distillation_set": "8e8b879a52223c71e105",
        "tokenized_dataset": "12af0f70ec4b9a77b238",
        "hparam_sweep": "4e442f02d9b2ba97ba24",
        "student_adapter": "49b65ee10330f6abc304",
        "evaluation_items": "b93b80ae2ad9c90965e6",
        "evaluation": "a4d70f8e1c29176f734d",
        "drift_evaluation": "edc100cc02af8749c83e",
    },
    "demo_moe": {
        "teacher_generations": "dcfa6c38d48d7995c58d",
        "distillation_set": "8e8b879a52223c71e105",
        "tokenized_dataset": "b8feefa6fe079a1998f2",
        "student_adapter": "4bcb5a4340a3fd444cf0",
        "evaluation_items": "9b3e4be9c757a306e16f",
        "evaluation": "36c5e275c00f107d290b",
        "drift_evaluation": "44fc190bc35f719532a4",
    },
    "demo_ray": {
        "teacher_generations": "dcfa6c38d48d7995c58d",
        "distillation_set": "fa50e71bd4a2d09891eb",
        "tokenized_dataset": "83e8b55b4496383f7a81",
        "student_adapter": "c7d425c251eb74ca6106",
        "evaluation_items": "1e5a2f36d193a6b6dcf7",
        "evaluation": "f854423a76915ef78981",
        "drift_evaluation": "5e559c961b61ddd01c61",
    },
    "smollm2": {
        "teacher_generations": "c7d4b9d08da20922d41f",
        "distillation_set": "227945463625abb0f839",
        "tokenized_dataset": "e6185f24efc9ce02550e",
        "student_adapter": "c0e59ca09a8887d866f3",
        "evaluation_items": "3d3bc592e82122a9ab3e",
        "evaluation": "0f18c080301d0751e139",
        "drift_evaluation": "a3787a63eb2e4ae1f2ba",
    },
    "smollm2_api": {
        "teacher_generations": "4ff58393bd80c7a7d7aa",
        "distillation_set": "08d13fd1545366b6fcc7",
        "tokenized_dataset": "3dc8efa1204ddabeb764",
        "student_adapter": "93b3c862f5a72b9cfc26",
        "evaluation_items": "0cc215c9dcfd42ae3762",
        "evaluation": "af10549f057f442dc1b3",
        "drift_evaluation": "3c47f4e7cf25126e22c6",
    },
    "smollm2_on_policy": {
        "student_adapter": "1e1321f81e9358329602",
        "evaluation_items": "d4f564b04c6fec344a8c",
        "evaluation": "82845e29abf65e2b05c3",
        "drift_evaluation": "6da48fd8b8a01392ed84",
    },
}

PROMPTS = {
    "demo": "694fed44c8d69cb93f85",
    "smollm2": "32dc96c6b4fab70b3b0f",
    "smollm2_api": "abf85de01603bf6fa204",
    "smollm2_on_policy": "32dc96c6b4fab70b3b0f",
}


class Captured(Exception):
    pass


class KeyStore(Store):
    """A store whose stage directories stop the stage at its content key (models resolve to ``/models/<name>``)."""

    def resolve_model(self, ref, base=None, revision=None, log=None):
        return Path("/models") / ref.split("/")[-1]

    def stage(self, campaign, stage, key):
        raise Captured(key)


@pytest.fixture
def stand_ins(monkeypatch):
    import campaign_orchestrator.dataset.tokenize as tok
    import campaign_orchestrator.hardware as hw
    import stages.common

    monkeypatch.setattr(hw, "key_precision", lambda requested, device=None, peak=None: "cpu:float32")
    monkeypatch.setattr(tok, "tokenizer_hash", lambda path: f"tok:{Path(path).name}")
    monkeypatch.setattr(stages.common, "model_fingerprint", lambda path, cache=None: f"fp:{Path(path).name}")


def captured(fn, *args) -> str:
    with pytest.raises(Captured) as e:
        fn(*args)
    return e.value.args[0]


def stage_keys(name: str, root: Path) -> dict[str, str]:
    from evaluation.judging import judging_key
    from stages import (
        distillation_set,
        drift_evaluation,
        evaluation,
        hparam_sweep,
        student_adapter,
        teacher_generations,
        tokenized_dataset,
    )
    from stages.common import model_identity

    spec = load_campaign_file(REPO_ROOT / "campaigns" / f"{name}.yaml")
    store = KeyStore(root=str(root))
    ctx = StageContext(store=store)
    prompts_file = root / "train.parquet"
    prompts_file.write_bytes(b"fixed prompts")
    prompts = {"key": "p" * 20, "train_sha256": "t" * 64, "heldout_sha256": "h" * 64, "train_path": str(prompts_file)}
    out = {}
    if not spec.training.distillation.skips_teacher:
        out["teacher_generations"] = captured(teacher_generations.run, spec, {"prompts": prompts}, ctx)
        gens = {"key": out["teacher_generations"]}
        out["distillation_set"] = distillation_set.content_key(spec, gens, prompts, store)
        dist = {"key": out["distillation_set"]}
        out["tokenized_dataset"] = captured(tokenized_dataset.run, spec, {"distillation": dist}, ctx)
        dataset = {"key": out["tokenized_dataset"]}
    else:
        dataset = dict(prompts)
    base = store.resolve_model(spec.student.base_model)
    if spec.sweep is not None:
        out["hparam_sweep"] = hparam_sweep.sweep_key(spec, dataset["key"], model_identity(base, spec.student.revision))
    inputs = {"dataset": dataset, "prompts": prompts}
    out["student_adapter"] = captured(student_adapter.run, spec, inputs, ctx)
    adapter = {"key": out["student_adapter"], "adapter_path": "/adapters/x"}
    out["evaluation_items"] = captured(evaluation.run, spec, {"prompts": prompts, "adapter": adapter}, ctx)
    out["evaluation"] = judging_key(spec, out["evaluation_items"])
    item_suites = [s for s in spec.evaluation.suites if s.kind == "items"]
    suites = [{"items": [{"id": "1", "prompt": "a", "reference": "b", "category": "c"}]} for _ in item_suites]
    promoted = SimpleNamespace(key=out["student_adapter"])
    out["drift_evaluation"] = drift_evaluation.content_key(spec, promoted, suites, item_suites, {"summary": "fixed"})
    return out


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_every_stage_keeps_its_content_key(name, tmp_path, stand_ins):
    assert stage_keys(name, tmp_path) == GOLDEN[name]


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_the_prompts_stage_keeps_its_content_key(name, tmp_path):
    from stages import prompts

    spec = load_campaign_file(REPO_ROOT / "campaigns" / f"{name}.yaml")
    assert (
        prompts.content_key(spec, prompts.prompt_files(spec, StageContext(store=Store(str(tmp_path))))) == PROMPTS[name]
    )
