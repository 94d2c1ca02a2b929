"""The real-model benchmarks' fixed inputs: SmolLM2-135M-Instruct and the smollm2 campaign's tokenized dataset.

``benchmarks/data/smollm2_distillation.jsonl`` is a frozen copy of the smollm2 campaign's distillation
set (the teacher's greedy answers to ``campaigns/data/smollm2/train-*.jsonl``, 292 examples, as the
distillation_set stage wrote them on 2026-12-01), so every run trains on the same text without
running the teacher. :func:`tokenized_dataset` builds it with the tokenized_dataset stage's own code
and settings (``assets.tokenized_dataset.build_settings`` on ``campaigns/smollm2.yaml``): chat
template, loss on the assistant turns only, best-fit-decreasing packing into rows of
``training.max_seq_len`` (128), padding ``free``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CAMPAIGN = REPO / "campaigns" / "smollm2.yaml"
DISTILLATION = REPO / "benchmarks" / "data" / "smollm2_distillation.jsonl"


# What the speed benchmarks train, pinned here rather than read from the campaign (which tunes its LoRA
# and loss for quality): LoRA r16 on every linear layer of the decoder, the cross-entropy loss TRL's
# SFTTrainer also computes.
BENCH_LORA = {
    "r": 16,
    "alpha": 32,
    "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def campaign():
    """campaigns/smollm2.yaml with the benchmarks' LoRA and loss (``BENCH_LORA``, ``loss: sequence``)."""
    import yaml

    from campaigns import paths
    from campaigns.loader import parse_campaign_text

    data = yaml.safe_load(CAMPAIGN.read_text())
    data["student"]["lora"] = dict(BENCH_LORA)
    data["training"]["distillation"] = {"loss": "sequence"}
    spec = parse_campaign_text(yaml.safe_dump(data), str(CAMPAIGN))
    spec.set_project_dir(paths.campaign_project_dir(CAMPAIGN))
    return spec


def model_dir(spec=None) -> Path:
    """The student's base model directory (a cache hit once ``campaign fetch-model`` has run)."""
    from campaign_orchestrator import models

    spec = spec or campaign()
    root = Path(os.environ.get("CAMPAIGN_TEST_MODELS_ROOT", REPO / "artifacts"))
    return models.resolve(spec.student.base_model, root, base=spec.project_dir)


def tokenized_dataset(out: Path, spec=None, num_proc: int | None = 1) -> dict:
    """Build the campaign's tokenized dataset from the frozen distillation set into ``out``; the stage's report."""
    import dataclasses

    from campaign_orchestrator.dataset.tokenize import build_tokenized_dataset
    from stages.tokenized_dataset import build_settings

    spec = spec or campaign()
    settings = dataclasses.replace(build_settings(spec), num_proc=num_proc)
    report = build_tokenized_dataset(model_dir(spec), [DISTILLATION], out, settings, base_dir=spec.project_dir)
    return report
