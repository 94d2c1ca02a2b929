"""Content keys change only on purpose: no artifact is rebuilt and nothing is paid again by accident.

The stage move (issue 44) changed no key: these values equalled the keys of main at 039f5fc. Issue 42 then changed
them once, on purpose, where a key held `auto`: ``dataset.template: auto`` is keyed as the template the tokenizer
resolves (``plain`` for the demo's, ``chat`` for SmolLM2's), an ``auto`` attention kernel or activation policy is left
out (speed only), and ``micro_batch_size`` is keyed as the number the trainer will run. So every shipped campaign
tokenizes, trains and evaluates once more; its teacher generations (the paid stage), distillation set and prompts keep
their keys.

``GOLDEN`` holds every stage's content key for the shipped campaigns as the code before the move computed them
(main at 039f5fc, the stages still in ``assets/``), with the same deterministic stand-ins for what is host- or
build-specific: a model's fingerprint (its directory name), the resolved precision (``cpu:float32``) and the
tokenizer hash; the upstream manifests are fixed dicts. ``PROMPTS`` are the prompts stages' keys over the shipped
data files, as that code computed them. The stages compute their keys here as ``run`` does (a store that stops at
the stage directory), so a change to any key's parts fails this test."""

from __future__ import annotations

from dataclasses import replace
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
        "tokenized_dataset": "daca22a3edd54ca88017",
        "student_adapter": "e13dc30b40f317574094",
        "evaluation_items": "7366480519725e938fea",
        "evaluation": "b0c907d7a51942c6c407",
        "drift_evaluation": "3c160859da5df60a86c1",
    },
    "demo_moe": {
        "teacher_generations": "dcfa6c38d48d7995c58d",
        "distillation_set": "8e8b879a52223c71e105",
        "tokenized_dataset": "2a263620f96bf2b43368",
        "student_adapter": "890c705b4ab9d03156a0",
        "evaluation_items": "82829cfb2425acd03630",
        "evaluation": "2cb58efab6ffc01f3332",
        "drift_evaluation": "f81f3003dd8cf1297374",
    },
    "demo_ray": {
        "teacher_generations": "dcfa6c38d48d7995c58d",
        "distillation_set": "fa50e71bd4a2d09891eb",
        "tokenized_dataset": "daca22a3edd54ca88017",
        "student_adapter": "e13dc30b40f317574094",
        "evaluation_items": "7366480519725e938fea",
        "evaluation": "b0c907d7a51942c6c407",
        "drift_evaluation": "3c160859da5df60a86c1",
    },
    "demo_sweep": {
        "teacher_generations": "dcfa6c38d48d7995c58d",
        "distillation_set": "8e8b879a52223c71e105",
        "tokenized_dataset": "3edb0ee85694ef8bed58",
        "hparam_sweep": "d45e67b514faca6fa459",
        "student_adapter": "1e6cb9971335a5e71aa9",
        "evaluation_items": "f4d48ae07b40f64f6226",
        "evaluation": "f2edcc08e89c5e52303c",
        "drift_evaluation": "0e97289a777b95da4adf",
    },
    "smollm2": {
        "teacher_generations": "c7d4b9d08da20922d41f",
        "distillation_set": "227945463625abb0f839",
        "tokenized_dataset": "141a78e1adbb97f0e86e",
        "student_adapter": "316d0aa55e585a9c8e34",
        "evaluation_items": "8bc4b3673eef27c7f49e",
        "evaluation": "f3cb08f35c625c7a751d",
        "drift_evaluation": "a9b4e9750748123b6543",
    },
    "smollm2_api": {
        "teacher_generations": "4ff58393bd80c7a7d7aa",
        "distillation_set": "08d13fd1545366b6fcc7",
        "tokenized_dataset": "c937cebd0d882ecdd69c",
        "student_adapter": "d2fe55da9607a21ed548",
        "evaluation_items": "f93711529bf327fc4480",
        "evaluation": "1882dc5d85f0ae4c30a4",
        "drift_evaluation": "a022f523824946693e69",
    },
    "smollm2_on_policy": {
        "student_adapter": "f9eed3bcfd8c412ad32f",
        "evaluation_items": "98b6d1a2480809f3c0d6",
        "evaluation": "9d57cd68103cd043de48",
        "drift_evaluation": "1250c08d90fac174d9e2",
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
    import campaign_orchestrator.dataset.tokenizer_files as tokenizer_files
    import campaign_orchestrator.hardware as hw
    import stages.common

    monkeypatch.setattr(hw, "key_precision", lambda requested, device=None, peak=None: "cpu:float32")
    monkeypatch.setattr(tok, "tokenizer_hash", lambda path: f"tok:{Path(path).name}")
    monkeypatch.setattr(tokenizer_files, "tokenizer_hash", lambda path: f"tok:{Path(path).name}")
    monkeypatch.setattr(stages.common, "model_fingerprint", lambda path, cache=None: f"fp:{Path(path).name}")

    def resolved(self, tokenizer_dir):  # `template: auto` as the shipped tokenizers resolve it (SmolLM2's has ChatML)
        kind = "chat" if "smollm2" in str(tokenizer_dir).lower() else "plain"
        return self if self.template != "auto" else replace(self, template=kind)

    monkeypatch.setattr(tok.BuildSettings, "resolved", resolved)


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
        precision = hparam_sweep.adapter_precision(spec)
        policy = hparam_sweep.key_policy(spec, ctx.pricing.catalog_for(spec), base, precision, None)
        fields = hparam_sweep.adapter_key_fields(spec, precision, policy)
        out["hparam_sweep"] = hparam_sweep.sweep_key(
            spec, dataset["key"], model_identity(base, spec.student.revision), fields
        )
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
