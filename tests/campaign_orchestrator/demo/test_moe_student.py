"""The demo MoE student base: its own recipe hash (changing it rebuilds nothing else), the demo
tokenizer (so the cipher teacher can be distilled into it), a Qwen3-MoE checkpoint that learned the
copy task and not the cipher."""

import json

import pytest

from campaign_orchestrator.demo import recipe


def test_the_moe_recipe_has_its_own_hash_and_directory(monkeypatch, tmp_path):
    dense, moe = recipe.recipe_hash(), recipe.moe_recipe_hash()
    assert recipe.resolve("@demo/moe_student", tmp_path) == tmp_path / "models" / f"demo-moe-{moe}" / "moe_student"
    assert recipe.resolve("@demo/student", tmp_path).parent == recipe.models_dir(tmp_path)
    monkeypatch.setitem(recipe.MOE_RECIPE["moe_student"], "steps", 201)
    assert recipe.moe_recipe_hash() != moe and recipe.recipe_hash() == dense
    with pytest.raises(ValueError, match="moe_student"):
        recipe.resolve("@demo/moe", tmp_path)


@pytest.mark.stage
def test_the_moe_student_is_a_qwen3_moe_with_the_demo_tokenizer(moe_student, demo_models):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(moe_student))
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe",
        4,
        2,
        48,
    )
    assert (
        AutoTokenizer.from_pretrained(str(moe_student)).get_vocab()
        == AutoTokenizer.from_pretrained(str(demo_models["teacher"])).get_vocab()
    )
    report = json.loads((moe_student.parent / "build_report.json").read_text())
    assert report["copy_exact_match"] >= 0.95 and report["exact_match"] <= 0.05  # it copies; it cannot encode yet
    assert report["parameters"] == 109_440 and (moe_student.parent / "_SUCCESS").exists()
