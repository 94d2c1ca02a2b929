"""Billed hardware is the hardware used: training priced per GPU-hour refuses to start where no GPU is
visible (before anything is loaded), unless `allow_cpu_fallback: true`, which trains on the CPU and is
billed as CPU time at `cpu_hardware`; a campaign names its training hardware (no silent default)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from campaign_orchestrator.costs.catalog import PricingError, billed_hardware
from campaigns.loader import CampaignError, parse_campaign_text
from tests.support import REPO_ROOT


def _spec(**training):
    d = yaml.safe_load((REPO_ROOT / "campaigns/demo.yaml").read_text())
    d["training"] |= training
    d["training"] = {k: v for k, v in d["training"].items() if v is not None}
    return parse_campaign_text(yaml.safe_dump(d))


def _catalog(spec):
    from stages.pricing import Pricing

    return Pricing().catalog_for(spec)


def test_a_campaign_names_its_training_hardware():
    with pytest.raises(CampaignError, match="training.hardware is required"):
        _spec(hardware=None)
    with pytest.raises(CampaignError, match="set `cpu_hardware`"):
        _spec(hardware="h100-sxm", allow_cpu_fallback=True)


def test_gpu_hardware_is_billed_only_when_a_gpu_ran_it():
    gpu = _spec(hardware="h100-sxm")
    assert billed_hardware(gpu, _catalog(gpu), "cuda") == ("h100-sxm", None)
    with pytest.raises(PricingError, match="priced per GPU-hour but training found no GPU"):
        billed_hardware(gpu, _catalog(gpu), "cpu")
    fallback = _spec(hardware="h100-sxm", allow_cpu_fallback=True, cpu_hardware="cpu-2vcpu")
    key, note = billed_hardware(fallback, _catalog(fallback), "cpu")
    assert key == "cpu-2vcpu" and "billed as CPU time at cpu-2vcpu, not at h100-sxm" in note
    cpu = _spec(hardware="cpu-2vcpu")
    assert billed_hardware(cpu, _catalog(cpu), "cpu") == ("cpu-2vcpu", None)


@pytest.mark.stage
def test_the_trainer_refuses_a_gpu_priced_job_without_a_gpu_before_loading_anything(tmp_path, demo_models):
    """`python -m training` itself (what a Kubernetes pod runs): no CUDA here, so a job priced per GPU-hour
    stops at once with the reason, before the data or the model is read."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal cannot happen here")
    from training.config import TrainJob

    def job(**training) -> str:
        spec = _spec(hardware="h100-sxm", **training)
        p = tmp_path / "job.json"
        TrainJob(
            campaign="demo",
            base_model_path=str(demo_models["student"]),
            dataset_path=str(tmp_path / "none"),
            output_dir=str(tmp_path / "out"),
            student=spec.student,
            training=spec.training,
            gpu_required=True,
        ).write(p)
        return str(p)

    r = subprocess.run(
        [sys.executable, "-m", "training", "--config", job()],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "training.hardware 'h100-sxm' is priced per GPU-hour but this process sees no GPU" in r.stderr
    assert not (tmp_path / "out" / "summary.json").exists()  # refused before training (no timing: the message says)
