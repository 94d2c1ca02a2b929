"""segment_eager attention (training.attention): per packed sequence, equal to eager attention over the block mask."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.attention_support import llama_pair, logits_and_grads
from training import attention


@pytest.fixture(scope="module")
def models():
    return llama_pair(attention.NAME)


_grads = logits_and_grads


def test_segments_of_a_packed_row():
    assert attention.segments(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [(0, 3), (3, 5), (5, 6)]
    assert attention.segments(torch.tensor([[0, 1, 2, 3]])) == [(0, 4)]


@pytest.mark.parametrize("layout", ["packed_row", "padded_rows"])
def test_segment_eager_equals_eager_on_packed_and_padded_batches(models, layout):
    eager, seg = models
    g = torch.Generator().manual_seed(1)
    if layout == "packed_row":  # padding-free: three sequences in one row; transformers masks the blocks for eager
        ids = torch.randint(3, 61, (1, 15), generator=g)
        pos = torch.cat([torch.arange(6), torch.arange(4), torch.arange(5)]).unsqueeze(0)
        kw_e = kw_s = {"input_ids": ids, "position_ids": pos}
    else:  # two rows; the second right-padded, its pads a position segment of their own (training.data.collate)
        ids = torch.randint(3, 61, (2, 9), generator=g)
        pos = torch.stack([torch.arange(9), torch.cat([torch.arange(6), torch.arange(3)])])
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0
        kw_e = kw_s = {"input_ids": ids, "position_ids": pos, "attention_mask": mask}
    le, ge = _grads(eager, **kw_e)
    ls, gs = _grads(seg, **kw_s)
    keep = torch.ones_like(ids, dtype=torch.bool) if layout == "packed_row" else kw_e["attention_mask"].bool()
    torch.testing.assert_close(ls[keep], le[keep], rtol=1e-5, atol=1e-5)
    if layout == "packed_row":
        for n in ge:
            torch.testing.assert_close(gs[n], ge[n], rtol=1e-4, atol=1e-6, msg=n)
    # a sequence's logits do not depend on its neighbours in the row
    if layout == "packed_row":
        alone = seg(input_ids=ids[:, 6:10], position_ids=pos[:, 6:10], use_cache=False).logits
        torch.testing.assert_close(ls[:, 6:10], alone, rtol=1e-5, atol=1e-5)


def test_the_kernel_is_chosen_by_measurement_at_the_shape_and_cached(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    kernel, rec = attention.choose_kernel(cfg, torch.device("cpu"), row_tokens=48, seq_len=12, cache_dir=str(tmp_path))
    assert kernel in attention.CANDIDATES and set(rec["seconds"]) == set(attention.CANDIDATES)
    assert kernel == min(rec["seconds"], key=rec["seconds"].get) and all(v > 0 for v in rec["seconds"].values())
    cached = json.loads((tmp_path / attention.CACHE_FILE).read_text())
    assert rec.pop("measured_now") is True and list(cached.values()) == [rec]
    # a later run (any rank of this host) reuses the measurement: the same kernel, no timing noise between runs
    key = next(iter(cached))
    cached[key] = rec | {"kernel": "eager" if kernel != "eager" else "sdpa"}
    (tmp_path / attention.CACHE_FILE).write_text(json.dumps(cached))
    again, _ = attention.choose_kernel(cfg, torch.device("cpu"), row_tokens=48, seq_len=12, cache_dir=str(tmp_path))
    assert again == cached[key]["kernel"]
    other, _ = attention.choose_kernel(cfg, torch.device("cpu"), row_tokens=96, seq_len=12, cache_dir=str(tmp_path))
    assert len(json.loads((tmp_path / attention.CACHE_FILE).read_text())) == 2 and other in attention.CANDIDATES


def test_batch_shape_of_a_packed_dataset():
    rows = {"position_ids": [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3]]}
    assert attention.batch_shape(rows, micro_batch=2) == (10, 3)
