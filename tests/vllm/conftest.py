"""The ``vllm`` tests: vLLM's CPU build for real (no stand-in), in the venv ``make vllm-venv`` makes (.venv-vllm:
vLLM pins a transformers older than the project's). ``make test-heavy`` runs them there with
``$CAMPAIGN_REQUIRE_VLLM`` set, so a missing vLLM fails them instead of skipping them.

vLLM starts its engine core in a process of its own (spawned) and holds a key/value cache sized by the project
(:func:`campaign_orchestrator.generation.engines.vllm_engine.cpu_kv_cache_bytes`); each fixture that starts one
stops it when its tests are done, so at most two engines are alive at a time."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REQUIRE_ENV = "CAMPAIGN_REQUIRE_VLLM"


@pytest.fixture(scope="session", autouse=True)
def _vllm_here():
    if importlib.util.find_spec("vllm") is None:
        msg = "vLLM is not importable here: these tests run in .venv-vllm (`make vllm-venv`; `make test-heavy`)"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{msg}, and ${REQUIRE_ENV} is set")
        pytest.skip(msg)


def close_engines(gen) -> None:
    """Stop every engine a LocalModel started (vLLM's engine-core process among them)."""
    for eng in list(gen.engines.values()):
        close = getattr(eng, "close", None)
        if close is not None:
            close()


def forced_logprobs(model, prompt_ids: list[int], new_ids: list[int]) -> tuple[list[float], list[int]]:
    """Through ``model`` (transformers or PEFT, fp32), teacher-forced on ``prompt_ids + new_ids``: the
    log-probability of each of ``new_ids`` and the argmax at each of their positions."""
    import torch

    ids = torch.tensor([prompt_ids + new_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, dim=-1)
    own = lp.gather(-1, torch.tensor(new_ids)[:, None])[:, 0]
    return own.tolist(), lp.argmax(-1).tolist()


def smollm2_prompts(n_plural: int, n_general: int) -> tuple[list, dict]:
    """Real prompts of the smollm2 campaign: plural questions under the teacher's few-shot context (chat
    messages) and general questions bare, and the campaign's teacher section."""
    import json

    import yaml

    from campaign_orchestrator.generation.requests import chat_messages
    from tests.support import REPO_ROOT

    spec = yaml.safe_load((REPO_ROOT / "campaigns" / "smollm2.yaml").read_text())
    data = Path(REPO_ROOT) / "campaigns" / "data" / "smollm2"

    def rows(name, n):
        if n == 0:
            return []
        lines = [json.loads(x) for x in (data / name).read_text().splitlines() if x.strip()]
        return lines[:: max(1, len(lines) // n)][:n]

    ctx = spec["teacher"]["context"]
    prompts = [chat_messages(r["prompt"], ctx) for r in rows("train-plural.jsonl", n_plural)]
    prompts += [r["prompt"] for r in rows("train-general.jsonl", n_general)]
    return prompts, spec["teacher"]
