"""The trainer's loader: memory-mapped shards, rank/worker splitting, resume, collation, and the
proof that packing does not leak attention (packed loss == sum of unpacked losses)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import torch

from campaign_orchestrator.dataset.packing import pack_bfd, pack_rows
from campaign_orchestrator.dataset.tokenize import write_shards
from training import data as tdata

META = {
    "campaign.tokenizer_hash": "t" * 64,
    "campaign.max_seq_len": "16",
    "campaign.padding": "free",
    "campaign.packing": "{}",
    "campaign.dataset_key": "k1",
    "campaign.split_name": "train",
}


def synthetic_examples(n: int, seed: int = 0, vocab: int = 50, max_len: int = 12) -> pa.Table:
    rng = random.Random(seed)
    seqs = [[rng.randint(4, vocab - 1) for _ in range(rng.randint(2, max_len))] for _ in range(n)]
    labels = [[-100] * (len(s) // 2) + s[len(s) // 2 :] for s in seqs]
    return pa.table(
        {
            "id": [f"e{i}" for i in range(n)],
            "input_ids": pa.array(seqs, pa.list_(pa.int32())),
            "labels": pa.array(labels, pa.list_(pa.int32())),
        }
    )


@pytest.fixture
def shards(tmp_path):
    """A packed dataset of 120 examples in several small shards."""
    ex = synthetic_examples(120)
    rows = pack_rows(ex, pack_bfd(pc_lengths(ex), 16))
    files = write_shards(rows, tmp_path / "ds" / "train", "train", target_bytes=1, metadata=META, row_group_rows=16)
    assert len(files) > 1
    return tmp_path / "ds", rows, tmp_path / "cache"


def pc_lengths(t: pa.Table) -> list[int]:
    return [len(x) for x in t.column("input_ids").to_pylist()]


def test_dataset_reads_every_row_memory_mapped(shards):
    path, rows, cache = shards
    ds = tdata.TokenizedDataset(path, cache_dir=cache)  # the dataset dir resolves to its train/ split
    assert len(ds) == rows.num_rows and ds.padding == "free" and ds.max_seq_len == 16
    want = rows.to_pylist()
    for i in range(len(ds)):
        r = ds[i]
        assert r["input_ids"].tolist() == want[i]["input_ids"]
        assert r["labels"].tolist() == want[i]["labels"]
        assert r["position_ids"].tolist() == want[i]["position_ids"]
    assert ds.total_tokens == sum(len(w["input_ids"]) for w in want)
    # reopening maps the cached Arrow files: zero-copy, nothing allocated from Arrow's memory pool
    before = pa.total_allocated_bytes()
    again = tdata.TokenizedDataset(path, cache_dir=cache)
    assert pa.total_allocated_bytes() - before < 4096
    assert again[len(again) - 1]["input_ids"].tolist() == want[-1]["input_ids"]
    # a spawned DataLoader worker gets the path, not the rows
    import pickle

    blob = pickle.dumps(ds)
    assert len(blob) < 2048 and pickle.loads(blob)[3]["input_ids"].tolist() == want[3]["input_ids"]
    # the trainer's legacy access pattern
    assert len(ds["input_ids"]) == len(ds) and ds["labels"][0].tolist() == want[0]["labels"]


def test_tokenizer_mismatch_and_mixed_shards_are_refused(shards, tmp_path):
    path, rows, cache = shards
    with pytest.raises(tdata.DatasetMismatch, match="tokenized with tokenizer tttttttttttt but the model"):
        tdata.TokenizedDataset(path, cache_dir=cache, expect_tokenizer_hash="m" * 64, model_dir="/models/x")
    assert tdata.dataset_tokenizer_hash(path) == "t" * 64
    write_shards(
        rows.slice(0, 3),
        tmp_path / "other",
        "train",
        1 << 20,
        META | {"campaign.tokenizer_hash": "u" * 64, "campaign.dataset_key": "k2"},
    )
    (path / "train" / "train-00000-of-00001.parquet").write_bytes(
        next((tmp_path / "other").glob("*.parquet")).read_bytes()
    )
    with pytest.raises(tdata.DatasetMismatch, match="different datasets"):
        tdata.TokenizedDataset(path, cache_dir=cache)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("rows,micro,accum", [(36, 2, 1), (31, 2, 2), (7, 3, 1)])
def test_ranks_cover_every_row_exactly_once_per_epoch(world, rows, micro, accum):
    plan = tdata.BatchPlan(rows, micro, world, accum, seed=3)
    rps = plan.rows_per_step
    steps = np.lcm(rows, rps) // rps  # a whole number of epochs, with steps straddling epoch ends
    epochs = steps * rps // rows
    taken: list[int] = []
    for step in range(steps):
        per_rank = [sum(plan.step_rows(step, r), []) for r in range(world)]
        flat = sum(per_rank, [])
        assert len(flat) == rps
        if step * rps // rows == ((step + 1) * rps - 1) // rows:  # a step inside one epoch: ranks share no row
            assert len(set(flat)) == len(flat)
        taken += flat
    assert Counter(taken) == {i: epochs for i in range(rows)}
    # and stream order: each epoch's rows are one permutation
    for e in range(epochs):
        assert sorted(plan.positions(e * rows, rows)) == list(range(rows))


def test_global_batch_is_the_same_whatever_the_world_size():
    one = tdata.BatchPlan(40, 4, 1, 2, seed=1)
    two = tdata.BatchPlan(40, 2, 2, 2, seed=1)
    for step in range(12):
        assert sorted(sum(one.step_rows(step, 0), [])) == sorted(
            sum(two.step_rows(step, 0) + two.step_rows(step, 1), [])
        )


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_split_steps_without_overlap_and_resume_mid_epoch(shards, monkeypatch, workers):
    path, _rows, cache = shards
    ds = tdata.TokenizedDataset(path, cache_dir=cache)
    plan = tdata.BatchPlan(len(ds), 2, 2, 2, seed=0)
    got: dict[int, list] = {}
    for w in range(workers):
        info = type("Info", (), {"id": w, "num_workers": workers})
        monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda info=info: info)
        for step, batches in tdata.StepStream(ds, plan, rank=1, start=3, stop=17, pad_id=0):
            assert step not in got
            got[step] = batches
    assert sorted(got) == list(range(3, 17))
    for step, batches in got.items():
        want = [tdata.collate(ds, idx, 0) for idx in plan.step_rows(step, 1)]
        for b, w in zip(batches, want, strict=True):
            assert all(torch.equal(b[k], w[k]) for k in w)
    # resume: a stream restored from a saved position continues exactly where the first one stopped
    first = tdata.StepStream(ds, plan, 1, 0, 17, 0)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: None)
    state = first.state_dict()
    resumed = tdata.StepStream(ds, plan, 1, 0, 17, 0)
    resumed.load_state_dict(state, consumed_step=8)
    assert [s for s, _ in resumed] == list(range(9, 17))
    other = tdata.StepStream(ds, tdata.BatchPlan(len(ds), 4, 2, 2, seed=0), 1, 0, 17, 0)
    with pytest.raises(tdata.DatasetMismatch, match="batch plan"):
        other.load_state_dict(state)


def test_dataloader_with_two_worker_processes_returns_steps_in_order(shards):
    path, _rows, cache = shards
    ds = tdata.TokenizedDataset(path, cache_dir=cache)
    plan = tdata.BatchPlan(len(ds), 2, 1, 1, seed=0)
    loader = tdata.make_loader(ds, plan, rank=0, start=5, stop=13, pad_id=0, num_workers=2)
    assert [step for step, _ in loader] == list(range(5, 13))


def test_collate_modes(shards):
    path, _rows, cache = shards
    ds = tdata.TokenizedDataset(path, cache_dir=cache)
    idx = [0, 3, 5]
    lens = [len(ds[i]["input_ids"]) for i in idx]
    free = tdata.collate(ds, idx, pad_id=0)
    assert free["input_ids"].shape == (1, sum(lens)) and "attention_mask" not in free
    assert int(free["real_tokens"]) == sum(lens)
    assert tdata.loss_token_count(free) == sum(int((ds[i]["labels"][1:] != -100).sum()) for i in idx)
    longest = tdata.collate(ds, idx, pad_id=0, padding="longest")
    assert longest["input_ids"].shape == (3, max(lens))
    assert "attention_mask" not in longest  # packed rows: the mask comes from position_ids
    fixed = tdata.collate(ds, idx, pad_id=0, padding="max_length")
    assert fixed["input_ids"].shape == (3, 16) and tdata.real_token_count(fixed) == sum(lens)
    assert (fixed["labels"][0, lens[0] :] == -100).all()
    # rows holding one sequence each: a classic attention mask
    plain = {c: [[5, 6, 7], [8, 9]] if c != "position_ids" else [[0, 1, 2], [0, 1]] for c in tdata.CORE_COLUMNS}
    b = tdata.collate(plain, [0, 1], pad_id=0)
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def _tiny_model(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg).eval()


def _loss_sum(model, batch) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k not in tdata.NON_MODEL_KEYS}
    logits = model(**inputs).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).double(),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_loss_equals_sum_of_unpacked_losses(attn):
    """The proof that packing does not leak attention across sequences."""
    model = _tiny_model(attn)
    ex = synthetic_examples(6, seed=7, max_len=10)
    seqs = ex.to_pylist()
    rows = pack_rows(ex, [[0, 1, 2], [3, 4, 5]])
    packed = {c: rows.column(c).to_pylist() for c in tdata.CORE_COLUMNS}
    single = {
        "input_ids": [s["input_ids"] for s in seqs],
        "labels": [s["labels"] for s in seqs],
        "position_ids": [list(range(len(s["input_ids"]))) for s in seqs],
    }
    with torch.no_grad():
        alone = sum(_loss_sum(model, tdata.collate(single, [i], 0)) for i in range(6))
        for mode in ("free", "longest", "max_length"):
            got = _loss_sum(model, tdata.collate(packed, [0, 1], 0, padding=mode, max_seq_len=40))
            assert torch.allclose(got, alone, rtol=1e-5, atol=1e-5), (mode, got, alone)
        # controls, each of which attends across sequences: positions that do not restart, and a KV cache
        # (config.use_cache) that makes transformers skip its packed-sequence detection
        leaky = tdata.collate(packed, [0, 1], 0, padding="free")
        leaky["position_ids"] = torch.arange(leaky["input_ids"].shape[1]).unsqueeze(0)
        assert not torch.allclose(_loss_sum(model, leaky), alone, rtol=1e-3)
        cached = tdata.collate(packed, [0, 1], 0, padding="free")
        del cached["use_cache"]
        assert model.config.use_cache and not torch.allclose(_loss_sum(model, cached), alone, rtol=1e-3)
