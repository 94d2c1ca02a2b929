"""QLoRA's 4-bit base under FSDP2: packed weights stored (and computing) in the compute dtype, checked before
sharding; the NF4 dequantization's share of a step, measured by the profiler (training/nf4_profile.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.stage  # the demo student, loaded 4-bit

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _student(path, load_in_4bit: bool):
    from campaigns.spec import StudentSpec
    from training.model import load_student

    st = StudentSpec.model_validate(
        {
            "base_model": str(path),
            "lora": LORA,
            "quantization": {"load_in_4bit": load_in_4bit, "compute_dtype": "float32"},
        }
    )
    torch.manual_seed(0)
    return load_student(str(path), st, torch.device("cpu"), attn_implementation="sdpa", compute_dtype="float32")


def test_packed_weights_are_stored_in_the_compute_dtype_and_a_mismatch_is_refused(demo_models):
    from training.model import check_4bit_storage

    model = _student(demo_models["student"], True)
    assert check_4bit_storage(model, torch.float32) == 2 * 7  # every projection of both layers is 4-bit
    with pytest.raises(
        ValueError,
        match=r"4-bit weight .*q_proj.* stored as torch.float32 .* shards it as "
        r"torch.bfloat16.*bnb_4bit_quant_storage",
    ):
        check_4bit_storage(model, torch.bfloat16)


def test_the_dequantization_share_of_a_qlora_step_is_measured(demo_models):
    from training.nf4_profile import dequant_share

    ids = torch.randint(3, 32, (4, 24), generator=torch.Generator().manual_seed(0))
    shares = {}
    for four_bit in (True, False):
        model = _student(demo_models["student"], four_bit)

        def step(model=model):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            model.zero_grad(set_to_none=True)

        shares[four_bit] = dequant_share(step, torch.device("cpu"), steps=2)
    q, plain = shares[True], shares[False]
    assert 0 < q["dequant_share"] < 1 and q["dequant_ms_per_step"] > 0 and q["clock"] == "cpu"
    assert q["dequant_calls_per_step"] >= 14  # every 4-bit linear (2 layers x 7) dequantizes in backward at least
    assert plain["dequant_share"] == 0 and plain["dequant_calls_per_step"] == 0
