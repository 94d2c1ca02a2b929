"""Shared by the dataset-stage tests: the demo student's tokenizer, a chat template in its
vocabulary, and expected ids built without calling the tokenizer on the text."""

from __future__ import annotations

import pytest

# A chat template in the demo vocabulary: "user =<text> assistant =<text></s> ".
CHAT = ("{% for m in messages %}{{ m['role'] }} ={{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
        "{% endif %} {% endfor %}{% if add_generation_prompt %}assistant ={% endif %}")


@pytest.fixture(scope="module")
def tok(demo_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_models["student"]))


@pytest.fixture
def chat_tok(demo_models):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(demo_models["student"]))
    t.chat_template = CHAT
    return t


def chars(tok, text: str) -> list[int]:
    """The demo tokenizer is character level: the expected ids, built without calling it on the text."""
    return [tok.convert_tokens_to_ids(c) for c in text]
