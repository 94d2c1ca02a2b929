"""The teacher server's /v1/chat/completions (the API stand-in of campaigns/smollm2_api.yaml): messages rendered
with the tokenizer's chat template answer exactly what the local engine answers for the same conversation, and a
tokenizer without a template is a 400 that says which route to use."""

from __future__ import annotations

import pytest

from campaign_orchestrator.teacher.server import TeacherServer, build_app

pytestmark = pytest.mark.stage

MSGS = [{"role": "system", "content": "encode words"}, {"role": "user", "content": "encode hello ="}]


def test_chat_completions_answer_as_the_local_engine_does(demo_models, chat_tok):
    from starlette.testclient import TestClient

    from campaign_orchestrator.generation.local import LocalModel

    gen = LocalModel.from_path(demo_models["teacher"], batch_size=4)
    plain = TestClient(build_app(TeacherServer(gen, "t")))
    r = plain.post("/v1/chat/completions", json={"model": "t", "messages": MSGS, "max_tokens": 8})
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]

    gen.tok = chat_tok  # the same vocabulary, with a chat template
    client = TestClient(build_app(TeacherServer(gen, "t")))
    r = client.post("/v1/chat/completions", json={"model": "t", "messages": MSGS, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = gen.generate([MSGS], max_new_tokens=8)[0]  # the engine renders a message list the same way
    ch = body["choices"][0]
    assert body["object"] == "chat.completion" and ch["message"] == {"role": "assistant", "content": expected.text}
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    bad = client.post("/v1/chat/completions", json={"model": "t", "messages": MSGS, "logprobs": True})
    assert bad.status_code == 400
