"""The demo's models (``campaign_orchestrator.demo``): the teacher and student bases every demo campaign reads, the
mixture-of-experts student and the teacher with a byte-level BPE tokenizer, built once per artifact root (cached by
their recipe's hash)."""

from __future__ import annotations

from pathlib import Path

from stages.storage import Store


def recipe_hashes() -> tuple[str, str, str]:
    """``(demo models' recipe hash, the MoE student's, the BPE teacher's)``: what the built models depend on."""
    from campaign_orchestrator.demo.recipe import moe_recipe_hash, recipe_hash, xtok_recipe_hash

    return recipe_hash(), moe_recipe_hash(), xtok_recipe_hash()


def demo_models(store: Store, log) -> tuple[dict, Path]:
    """The demo teacher and student (built unless a built set is there: building imports torch): ``(their build
    report, the folder holding them)``."""
    from campaign_orchestrator.demo.recipe import cached_report, models_dir

    report = cached_report(store.root_path())
    if report is None:  # build them (imports torch; a built set is only read)
        from campaign_orchestrator.demo.build import build_demo_models

        report = build_demo_models(store.root_path(), log=log, moe=False)
    return report, models_dir(store.root_path())


def moe_student(store: Store, log) -> tuple[dict, Path]:
    """The demo mixture-of-experts student base, built once: ``(its build report, its directory)``."""
    from campaign_orchestrator.demo.build import build_moe_student
    from campaign_orchestrator.demo.recipe import resolve

    r = build_moe_student(store.root_path(), log=log)
    return r, resolve("@demo/moe_student", store.root_path())


def xtok_teacher(store: Store, log) -> tuple[dict, Path]:
    """The demo teacher with a byte-level BPE tokenizer (another tokenizer than the student's: cross-tokenizer logit
    distillation), built once: ``(its build report, its directory)``."""
    from campaign_orchestrator.demo.build import build_xtok_teacher
    from campaign_orchestrator.demo.recipe import resolve

    r = build_xtok_teacher(store.root_path(), log=log)
    return r, resolve("@demo/teacher_bpe", store.root_path())
