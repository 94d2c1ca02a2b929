"""The adapter's content key names what changes the trained adapter, resolved for the device it is trained on
(campaign_orchestrator/keys.py): ``micro_batch_size: auto`` enters as the micro-batch the trainer will pick there,
never as ``auto``; speed-only ``auto`` choices stay out; a campaign with no ``auto`` keeps the key it had."""

from __future__ import annotations

import json

import pytest

from campaign_orchestrator.content import UnresolvedKeyWarning, stage_key, unresolved, value_sha256
from campaign_orchestrator.costs.memory_policy import DeviceFacts
from campaign_orchestrator.keys import adapter_key_fields, key_policy, policy_mismatch, training_key_fields
from campaigns.spec import CampaignSpec
from tests.support.train_support import demo_spec

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINYLLAMA = {
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def _spec(**training) -> CampaignSpec:
    d = demo_spec().model_dump(mode="json", by_alias=True, exclude_unset=True)
    d["training"] |= {"max_seq_len": 1024} | training
    if training:  # TinyLlama's runs: LoRA r16 on all seven projections of the bf16 base
        d["student"]["lora"] = {"r": 16, "alpha": 32, "target_modules": ALL7}
        d["student"]["quantization"] = {"load_in_4bit": False, "compute_dtype": "bfloat16"}
    return CampaignSpec.model_validate(d)


def _key(spec, policy, precision="cuda:bfloat16") -> str:
    """The adapter's key as the stage makes it (its version, the dataset and base identities, the fields)."""
    return stage_key("adapter/v1", "dataset-key", "base-id", adapter_key_fields(spec, precision, policy))


@pytest.fixture
def tinyllama(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINYLLAMA))
    return tmp_path


def test_an_auto_micro_batch_keys_what_each_device_trains(tinyllama, recwarn):
    """24 GB and 80 GB cards pick different micro-batches for TinyLlama at 1024 tokens without compile (12 and 16), so
    their adapters differ (the effective batch differs); two cards that pick the same micro-batch train the same and
    share the adapter, whatever each recomputes in backward (speed only)."""
    spec = _spec(micro_batch_size="auto", activation_checkpointing="auto", compile=False)
    policies = {
        gb: key_policy(spec, None, tinyllama, "cuda:bfloat16", device=DeviceFacts("cuda", gb)) for gb in (24, 80, 141)
    }
    assert policies[24].micro_batch_size != policies[80].micro_batch_size
    assert _key(spec, policies[24]) != _key(spec, policies[80])
    assert policies[80].micro_batch_size == policies[141].micro_batch_size  # both pick 16: one adapter
    assert _key(spec, policies[80]) == _key(spec, policies[141])
    for p in policies.values():  # the key's inputs hold the numbers, never `auto`
        fields = adapter_key_fields(spec, "cuda:bfloat16", p)
        assert unresolved(fields) == [] and fields["training"]["micro_batch_size"] == p.micro_batch_size
    assert not [w for w in recwarn if issubclass(w.category, UnresolvedKeyWarning)]
    compiled = _spec(micro_batch_size="auto", activation_checkpointing="auto", compile=True)
    on = {gb: key_policy(compiled, None, tinyllama, "cuda:bfloat16", device=DeviceFacts("cuda", gb)) for gb in (24, 80)}
    assert (on[24].micro_batch_size, on[80].micro_batch_size) == (16, 16)  # the 24 GB card checkpoints to fit it
    assert on[24].activation_policy != on[80].activation_policy and _key(compiled, on[24]) == _key(compiled, on[80])
    # what rows there are caps it, as the trainer caps it: 5 rows fill a micro-batch of 5 at most
    capped = key_policy(spec, None, tinyllama, "cuda:bfloat16", train_rows=5, device=DeviceFacts("cuda", 80))
    assert capped.micro_batch_size == 5 and _key(spec, capped) != _key(spec, policies[80])


def test_a_key_with_auto_is_named_and_a_set_micro_batch_needs_no_device():
    spec = _spec(micro_batch_size="auto")
    with pytest.raises(ValueError, match="micro_batch_size is 'auto'"):
        training_key_fields(spec, "cuda:bfloat16")  # no resolved micro-batch: refused, never hashed as `auto`
    assert unresolved({"a": [1, {"b": "auto"}], "c": "x"}) == ["a[1].b"]
    with pytest.warns(UnresolvedKeyWarning, match=r"\[1\].training.micro_batch_size"):
        stage_key("adapter/v1", training_key_fields(spec))  # the spec as written: `auto` named where it is keyed
    assert key_policy(_spec(), None, "no-model-needed", "cpu:float32") is None


def test_campaigns_without_auto_keep_the_key_they_had():
    """The fields of a campaign that sets everything (attention kernel, dtype, micro-batch, activation policy)
    hash as they did before keys were resolved (the hashes were computed with the code of main at 039f5fc), so no
    adapter is trained again for this change."""
    d = demo_spec().model_dump(mode="json", by_alias=True, exclude_unset=True)
    d["student"]["attn_implementation"] = "sdpa"
    d["student"]["quantization"]["compute_dtype"] = "float32"
    spec = CampaignSpec.model_validate(d)
    assert value_sha256(adapter_key_fields(spec, "cpu:float32")) == (
        "4da08a0161785970b0b790c1f288ae5c14bc14dc0894b9107414d9d5c58a9f3e"
    )
    d["training"] |= {"activation_checkpointing": "full", "micro_batch_size": 6}
    assert value_sha256(adapter_key_fields(CampaignSpec.model_validate(d), "cuda:float32")) == (
        "67e1b7bfcff4daddb7b416fa50cc86f0070aa4815c85eb458c9a22f41e5b3910"
    )


def test_an_adapter_trained_with_another_micro_batch_than_keyed_is_refused(tinyllama):
    spec = _spec(micro_batch_size="auto")
    p = key_policy(spec, None, tinyllama, "cuda:bfloat16", device=DeviceFacts("cuda", 24))
    assert policy_mismatch({"training_policy": {"micro_batch_size": p.micro_batch_size}}, p) is None
    why = policy_mismatch({"training_policy": {"micro_batch_size": p.micro_batch_size + 4}}, p)
    assert why and f"made for {p.micro_batch_size}" in why and "24 GB" in why
    assert (
        policy_mismatch({}, p) is None and policy_mismatch({"training_policy": {"micro_batch_size": 3}}, None) is None
    )


def test_example_loss_normalization_is_keyed_and_the_token_default_is_not():
    spec = demo_spec()
    token = training_key_fields(spec, "cpu:float32")
    assert "loss_normalization" not in token["training"]  # the default: every adapter keeps the key it had
    training = spec.training.model_copy(update={"loss_normalization": "example"})
    example = training_key_fields(spec.model_copy(update={"training": training}), "cpu:float32")
    assert example["training"]["loss_normalization"] == "example"
    assert value_sha256(example) != value_sha256(token)
