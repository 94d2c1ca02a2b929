"""Cross-tokenizer logit distillation at validation: the shipped demo campaign validates, and what cannot work
(an API teacher that returns no log-probabilities, or fewer than asked) is refused by `campaign validate`, with
the file, line, field and what to write, before anything is paid; an API that says nothing and answers without
them stops at its first answer."""

from __future__ import annotations

import pytest
import yaml

from campaign_app.cli import main
from campaign_orchestrator.costs.catalog import PricingError, read_catalog
from campaign_orchestrator.generation.openai_client import EndpointError, OpenAICompatibleClient
from tests.support import REPO_ROOT as REPO
from tests.support.testserver import ServerConfig, ServerThread


def test_the_shipped_cross_tokenizer_demo_validates(capsys):
    assert main(["validate", str(REPO / "campaigns" / "demo_xtok.yaml")]) == 0
    spec = yaml.safe_load((REPO / "campaigns" / "demo_xtok.yaml").read_text())
    assert spec["teacher"]["model"] == "@demo/teacher_bpe" and spec["training"]["distillation"]["loss"] == "logits"


def _api_campaign(tmp_path, top_logprobs: int | None, k: int | None = 8):
    """The demo with an API teacher priced by a catalog entry that says how many log-probabilities it returns."""
    catalog = yaml.safe_load((REPO / "campaigns" / "pricing" / "catalog.yaml").read_text())
    if top_logprobs is not None:
        catalog["entries"]["api-open-70b"]["top_logprobs"] = top_logprobs
    (tmp_path / "catalog.yaml").write_text(yaml.safe_dump(catalog))
    spec = yaml.safe_load((REPO / "campaigns" / "demo_xtok.yaml").read_text())
    spec["teacher"] = {
        "backend": "openai",
        "base_url": "http://127.0.0.1:9/v1",
        "model": "cipher-teacher",
        "price": "api-open-70b",
        "sampling": {"temperature": 0.0, "max_new_tokens": 16, **({"logprobs": k} if k else {})},
    }
    spec["cost"]["catalog"] = str(tmp_path / "catalog.yaml")
    spec["data"]["source"] = str(REPO / "campaigns" / "data" / "demo" / "*.jsonl")
    f = tmp_path / "campaigns" / "api_xtok.yaml"
    f.parent.mkdir(exist_ok=True)
    text = yaml.safe_dump(spec, sort_keys=False)
    f.write_text(text)
    return f, text.splitlines()


def _line(lines: list[str], needle: str) -> int:
    return next(i + 1 for i, x in enumerate(lines) if needle in x)


def test_an_api_that_returns_no_logprobs_is_refused_at_validation(tmp_path, capsys):
    f, lines = _api_campaign(tmp_path, top_logprobs=0)
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out
    want = f"{f}:{_line(lines, 'loss: logits')}: training.distillation.loss: 'logits' needs the teacher's top-k"
    assert want in out, out
    assert "its API returns none (pricing-catalog entry 'api-open-70b': top_logprobs: 0)" in out
    assert "write `loss: sequence` (and remove teacher.sampling.logprobs)" in out


def test_an_api_that_returns_fewer_logprobs_than_asked_is_refused(tmp_path, capsys):
    f, lines = _api_campaign(tmp_path, top_logprobs=5, k=8)
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out
    assert f"{f}:{_line(lines, 'logprobs: 8')}: teacher.sampling.logprobs: asks for the top 8" in out, out
    assert "returns at most 5 (pricing-catalog entry 'api-open-70b': top_logprobs: 5): write `logprobs: 5`" in out


def test_an_api_teacher_with_logprobs_and_another_tokenizer_validates(tmp_path, capsys):
    for cap in (None, 20):  # an entry that does not say is trusted; one that returns enough passes
        f, _ = _api_campaign(tmp_path, top_logprobs=cap)
        assert main(["validate", str(f)]) == 0, capsys.readouterr().out


def test_logit_distillation_without_logprobs_is_refused(tmp_path, capsys):
    f, _ = _api_campaign(tmp_path, top_logprobs=None, k=None)
    assert main(["validate", str(f)]) == 1
    assert "'logits' needs the teacher's top-k log-probabilities: set teacher.sampling.logprobs" in (
        capsys.readouterr().out
    )


def test_a_catalog_capability_must_be_a_count_on_an_api_entry(tmp_path):
    catalog = yaml.safe_load((REPO / "campaigns" / "pricing" / "catalog.yaml").read_text())
    catalog["entries"]["cpu-2vcpu"]["top_logprobs"] = 5
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(catalog))
    with pytest.raises(PricingError, match=r"entries.cpu-2vcpu.top_logprobs .* got 5 on a host-hour entry"):
        read_catalog(tmp_path / "c.yaml")


def test_an_api_answering_without_logprobs_stops_at_its_first_answer():
    """An endpoint whose catalog entry says nothing, asked for top-k, answers without: the client stops (the
    teacher stage fails) instead of paying for every prompt and leaving the dataset stage nothing to distil."""
    prompts = [f"encode {w} =" for w in ("abc", "hello", "zzz", "qwerty", "mno", "pqr", "stu", "vwx")] * 8
    with ServerThread(ServerConfig(latency_s=0.02, logprobs=False)) as srv:
        client = OpenAICompatibleClient(srv.base_url, "teacher", max_concurrency=2)
        with pytest.raises(EndpointError, match=r"answered without log-probabilities, but teacher.sampling.logprobs"):
            client.generate(prompts, max_new_tokens=8, logprobs=3)
        assert srv.stats.received < len(prompts) // 4  # stopped at once, not after every prompt
