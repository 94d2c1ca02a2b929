"""Shared by the dataset-stage tests: a chat template in the demo vocabulary, and expected ids built without calling
the tokenizer on the text."""

from __future__ import annotations

# A chat template in the demo vocabulary: "user =<text> assistant =<text></s> ".
CHAT = (
    "{% for m in messages %}{{ m['role'] }} ={{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %} {% endfor %}{% if add_generation_prompt %}assistant ={% endif %}"
)


def chars(tok, text: str) -> list[int]:
    """The demo tokenizer is character level: the expected ids, built without calling it on the text."""
    return [tok.convert_tokens_to_ids(c) for c in text]
