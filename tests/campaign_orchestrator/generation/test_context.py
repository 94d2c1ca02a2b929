"""teacher.context: the messages before a prompt (context distillation), for every prompt or some categories."""

from __future__ import annotations

import pytest

from campaign_orchestrator.generation.requests import Sampling, build_requests
from campaigns.spec import TeacherSpec

CTX = [
    {"role": "system", "content": "Reply in lowercase."},
    {"role": "user", "content": "Plural of desk?"},
    {"role": "assistant", "content": "desks"},
]


def test_context_makes_chat_requests_and_is_part_of_the_key():
    s = Sampling()
    bare = build_requests("t", s, ["Plural of cat?", "Capital of France?"])
    ctx = build_requests("t", s, ["Plural of cat?", "Capital of France?"], context=CTX)
    assert bare[0][0].messages is None and ctx[0][0].messages[-1] == {"role": "user", "content": "Plural of cat?"}
    assert list(ctx[0][0].messages[:3]) == CTX and bare[0][0].key != ctx[0][0].key
    some = build_requests("t", s, ["Plural of cat?", "Capital of France?"], context=CTX, with_context=[True, False])
    assert some[0][0].key == ctx[0][0].key and some[1][0].key == bare[1][0].key and some[1][0].messages is None


def test_spec_rules():
    base = {"model": "@demo/teacher", "hardware": "cpu-2vcpu"}
    with pytest.raises(ValueError, match="must not end with a user message"):
        TeacherSpec(**base, context=CTX[:2])
    with pytest.raises(ValueError, match="there is no `context`"):
        TeacherSpec(**base, context_categories=["plural"])
    with pytest.raises(ValueError, match="need `chat: true`"):
        TeacherSpec(backend="openai", model="m", base_url="http://x/v1", price="unpriced", context=CTX)
    assert TeacherSpec(**base, context=CTX, context_categories=["plural"]).context[0].role == "system"
