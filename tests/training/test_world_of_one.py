"""A world of one trains the plain module, with the loss and LoRA gradients of the FSDP2-wrapped one (gloo, one
process); the sharded path honours ``training.reshard_after_forward``."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.conftest import DIST_ENV
from tests.support.train_support import make_job, write_cipher_dataset

pytestmark = pytest.mark.stage  # real recipes on the demo student

SMALL = {
    "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "quantization": {"load_in_4bit": False, "compute_dtype": "float32"},
}


@pytest.fixture
def world_of_one(monkeypatch):
    def env():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in zip(DIST_ENV, ("0", "0", "1", "1", "127.0.0.1", str(port)), strict=True):
            monkeypatch.setenv(k, v)

    return env


def _first_step(job, world_of_one, wrap: bool, probe=None) -> tuple[dict, dict]:
    """One step's loss and LoRA gradients (full tensors) of the recipe, wrapped in FSDP2 or not."""
    from torch.distributed.fsdp import FSDPModule

    from training.recipes import LoraFinetuneRecipe
    from training.sharded import full_tensor

    world_of_one()
    r = LoraFinetuneRecipe(job)
    r.shard_single_process = wrap  # the benchmarks' switch; a run never wraps a world of one
    try:
        r.setup()
        assert isinstance(r.model, FSDPModule) is wrap and (r.mesh is not None) is wrap
        seen = probe(r) if probe is not None else None
        batches, counts, _ = r.prepare(0)
        res = r.accumulate(batches, counts)
        grads = {
            n.replace("._checkpoint_wrapped_module", ""): full_tensor(p.grad).detach().clone()
            for n, p in r.named_trainable
        }
        return {"loss": res.loss, "seen": seen}, grads
    finally:
        r.cleanup()


def test_a_world_of_one_trains_unwrapped_with_the_losses_and_gradients_of_fsdp2(tmp_path, demo_models, world_of_one):
    ds = write_cipher_dataset(tmp_path / "ds", demo_models["student"], 16, seed=3)

    def job(name, **kw):
        return make_job(
            tmp_path / name,
            demo_models["student"],
            ds,
            student=SMALL,
            max_steps=1,
            micro_batch_size=4,
            gradient_accumulation_steps=2,
            eval_rows=0,
            **kw,
        )

    def gathered_after_forward(r) -> bool:
        """Whether the first layer's parameters stay unsharded (gathered) after a forward, before backward."""
        from torch.distributed.tensor import DTensor

        from training.model import _decoder_layers

        batch = {k: v for k, v in r._batch(r.plan.step_rows(0, 0)[0]).items()}
        logits = r._forward(r._scored(batch))
        layer = _decoder_layers(r.model)[0]
        gathered = not isinstance(next(layer.parameters()), DTensor)
        logits.sum().backward()  # finish the pass (FSDP2 reshards in backward); gradients zeroed below
        r.optimizer.zero_grad(set_to_none=True)
        return gathered

    plain, g_plain = _first_step(job("plain"), world_of_one, wrap=False)
    kept, g_kept = _first_step(
        job("kept", reshard_after_forward=False), world_of_one, wrap=True, probe=gathered_after_forward
    )
    freed, g_freed = _first_step(
        job("freed", reshard_after_forward=True), world_of_one, wrap=True, probe=gathered_after_forward
    )
    assert kept["seen"] is True and freed["seen"] is False  # reshard_after_forward reaches fully_shard
    assert len(g_plain) == 12 and set(g_plain) == set(g_kept) == set(g_freed)
    for other, grads in ((kept, g_kept), (freed, g_freed)):
        assert other["loss"] == pytest.approx(plain["loss"], rel=1e-6)
        for k, g in g_plain.items():
            assert float(g.abs().sum()) > 0 or "lora_A" in k, k
            torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-7, msg=k)
