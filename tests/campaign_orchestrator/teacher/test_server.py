"""The project's teacher server (campaign_orchestrator.teacher.server) on the demo teacher, in process through
Starlette's test client: vLLM's ``prompt_logprobs`` shape and values, generation with max_tokens 0, 1 and more,
batched prompts, and the errors a client sees. The real server process is exercised in test_scoring_http."""

from __future__ import annotations

import pytest

from campaign_orchestrator.teacher.server import TeacherServer, build_app

NAME = "demo-teacher"
KEY = "sk-test-server-0123456789"


@pytest.fixture(scope="module")
def gen(demo_models):
    from campaign_orchestrator.generation.local import LocalModel

    return LocalModel.from_path(demo_models["teacher"], batch_size=4)


@pytest.fixture(scope="module")
def client(gen):
    from starlette.testclient import TestClient

    return TestClient(build_app(TeacherServer(gen, NAME, max_batch_tokens=40)))


def post(client, **body):
    r = client.post("/v1/completions", json={"model": NAME, **body})
    return r.status_code, r.json()


def test_prompt_logprobs_have_vllms_shape_and_the_models_values(client, gen):
    text = "encode abc ="
    ids = gen.tok(text)["input_ids"]  # vLLM tokenizes a text prompt with the special tokens (here <s>)
    code, by_text = post(client, prompt=text, max_tokens=0, prompt_logprobs=3, return_token_ids=True)
    assert code == 200, by_text
    choice = by_text["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["text"] == "" and choice["token_ids"] == []
    assert by_text["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None  # nothing predicts the first token
    for pos, tid in zip(plp[1:], ids[1:], strict=True):
        own = pos[str(tid)]  # JSON keys are the ids as strings, as vLLM sends them
        top = sorted((e for e in pos.values() if e["rank"] <= 3), key=lambda e: e["rank"])
        assert [e["rank"] for e in top] == [1, 2, 3] and len(pos) in (3, 4)
        assert [e["logprob"] for e in top] == sorted((e["logprob"] for e in top), reverse=True)
        assert own["rank"] == 1 + sum(e["logprob"] > own["logprob"] for e in top) or own["rank"] > 3
        assert own["decoded_token"] == gen.tok.decode([tid]) and own["logprob"] <= 0
    # the same prompt as token ids: the same answer
    assert post(client, prompt=ids, max_tokens=0, prompt_logprobs=3)[1]["choices"][0]["prompt_logprobs"] == plp
    # the values are the model's: LocalModel.score of the last tokens given the first ones
    cut = 4
    scored = gen.score([gen.tok.decode(ids[1:cut])], [ids[cut:]], top_k=3)[0]
    assert [pos[str(t)]["logprob"] for pos, t in zip(plp[cut:], ids[cut:], strict=True)] == pytest.approx(
        scored.logprobs, abs=1e-5
    )


def test_generation_with_max_tokens_zero_one_and_more(client, gen):
    prompt = "encode hello ="
    expected = gen.generate([prompt], max_new_tokens=8)[0]  # greedy, [bos] + prompt (no chat template)
    code, full = post(client, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, return_token_ids=True)
    assert code == 200, full
    c = full["choices"][0]
    assert c["text"] == expected.text and c["token_ids"] == expected.token_ids and c["finish_reason"] == "stop"
    assert full["usage"]["completion_tokens"] == len(expected.token_ids)
    assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["top_logprobs"]) == len(expected.token_ids)
    assert all(len(t) == 2 for t in c["logprobs"]["top_logprobs"])
    one = post(client, prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=1, return_token_ids=True)[1]
    c1 = one["choices"][0]
    assert c1["token_ids"] == expected.token_ids[:1] and c1["finish_reason"] == "length"
    assert one["usage"]["completion_tokens"] == 1 and len(c1["prompt_logprobs"]) == one["usage"]["prompt_tokens"]
    sampled = [
        post(client, prompt=prompt, max_tokens=4, temperature=1.5, seed=s, return_token_ids=True)[1]["choices"][0][
            "token_ids"
        ]
        for s in (1, 1, 2)
    ]
    assert sampled[0] == sampled[1]  # a seed fixes the sample


def test_batched_prompts_answer_each_as_alone(client, gen):
    seqs = [gen.tok(p)["input_ids"] for p in ("encode ab =", "encode longerword =", "encode xyz =")]
    code, batch = post(client, prompt=seqs, max_tokens=0, prompt_logprobs=2)
    assert code == 200 and [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for s, c in zip(seqs, batch["choices"], strict=True):  # padded in a batch of 40 positions or alone: the same
        alone = post(client, prompt=s, max_tokens=0, prompt_logprobs=2)[1]["choices"][0]["prompt_logprobs"]
        assert len(c["prompt_logprobs"]) == len(s)
        for a, b in zip(c["prompt_logprobs"][1:], alone[1:], strict=True):
            assert a.keys() == b.keys()
            assert [e["logprob"] for e in a.values()] == pytest.approx([e["logprob"] for e in b.values()], abs=1e-5)
    assert batch["usage"]["prompt_tokens"] == sum(map(len, seqs))


def test_models_and_the_errors_a_client_sees(client, gen):
    listed = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [NAME] and listed[0]["max_model_len"] == gen.context_length
    code, body = post(client, prompt="encode " + "abcdefgh" * 8 + " =", max_tokens=1)
    assert code == 400 and "maximum context length is 64 tokens" in body["error"]["message"]
    code, body = post(client, prompt="encode ab =", prompt_logprobs=21)
    assert code == 400 and "`prompt_logprobs` must be an integer 0..20" in body["error"]["message"]
    assert post(client, prompt=[])[0] == 400 and post(client, prompt=[10**6])[0] == 400
    assert post(client, prompt="x", n=2)[0] == 400
    r = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and "other" in r.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"{not json").status_code == 400


def test_an_api_key_is_required_when_set_and_never_echoed(gen):
    from starlette.testclient import TestClient

    server = TeacherServer(gen, NAME, api_key=KEY)
    keyed = TestClient(build_app(server))
    assert KEY not in repr(server)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = keyed.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 0}, headers=headers)
        assert r.status_code == 401 and KEY not in r.text
        assert keyed.get("/v1/models", headers=headers).status_code == 401
    r = keyed.post(
        "/v1/completions",
        json={"model": NAME, "prompt": "x", "max_tokens": 0},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200
