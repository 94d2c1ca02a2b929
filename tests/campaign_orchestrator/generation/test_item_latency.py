"""Per-item latency is measured per item: in a locally generated batch, a short answer is done (and
timed) when its last token is, not when the batch's longest answer is."""

from __future__ import annotations

import pytest

from campaign_orchestrator.demo import cipher

pytestmark = pytest.mark.stage


def test_local_generation_times_each_item_to_its_last_token(demo_models):
    from campaign_orchestrator.generation.local import LocalModel

    gen = LocalModel.from_path(demo_models["teacher"], batch_size=8, device="cpu")
    prompts = [
        cipher.prompt_for("ab"),
        cipher.prompt_for("abcdefgh"),
        cipher.prompt_for("xy"),
        cipher.prompt_for("qrstuvwx"),
    ]
    t = __import__("time").perf_counter()
    outs = gen.generate(prompts, max_new_tokens=16)
    batch_s = __import__("time").perf_counter() - t
    short, long_ = [outs[0], outs[2]], [outs[1], outs[3]]
    assert all(o.completion_tokens < p.completion_tokens for o in short for p in long_)
    assert max(o.latency_s for o in short) < min(o.latency_s for o in long_)  # not one batch time for all
    assert all(0 < o.latency_s <= batch_s for o in outs)
