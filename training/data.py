"""The trainer's data: memory-mapped packed rows, a step-indexed batch plan, and the collator.

* ``TokenizedDataset`` is a map-style ``torch`` dataset over the Parquet shards of one split.
  Each shard is decoded once into an uncompressed Arrow IPC file in a local cache and then
  memory-mapped: a row is a zero-copy slice of the mapped file, so ranks on one machine share
  the page cache and no process holds the dataset in its own memory. It refuses shards of
  different datasets in one directory and, when told the model's tokenizer hash, a dataset
  tokenized with another tokenizer (``DatasetMismatch``).
* ``BatchPlan`` makes every batch a pure function of (global optimizer step, rank): the rows
  form one stream of seeded per-epoch permutations laid end to end; optimizer step ``s`` takes
  stream positions ``[s·R, (s+1)·R)`` with ``R = micro_batch × world × accumulation``, and rank
  ``r``'s micro-batch ``a`` is the slice starting at ``s·R + (a·world + r)·micro_batch``. Ranks
  never overlap, no row is lost at an epoch boundary (a step may straddle two epochs), the
  global batch is the same whatever the world size, and resuming from a saved step replays
  nothing and skips nothing.
* ``StepStream`` is the same plan as a ``torch`` ``IterableDataset`` for a ``DataLoader`` with
  workers: worker ``w`` of ``W`` builds steps ``start + w, start + w + W, ...`` and the
  ``DataLoader``'s round-robin hands them back in step order.
* ``collate`` builds the model inputs. Packed rows carry ``position_ids`` that restart at 0 per
  sequence and **no** ``attention_mask``: transformers then derives the block-diagonal causal
  mask from the position ids (SDPA, eager, flex), and flash-attention uses varlen kernels on a
  flattened batch. Padding modes (the dataset's ``campaign.padding`` metadata, set by
  ``dataset.padding`` in the spec):

  Every batch also carries ``use_cache = tensor(False)``: transformers otherwise builds a KV
  cache from ``config.use_cache`` (true in most checkpoints) even in training, and it skips the
  packed-sequence detection whenever a cache exists, so packed sequences would attend to each
  other (verified in transformers 5.x ``masking_utils._preprocess_mask_arguments``). It is a
  0-d tensor so that ``{k: v.to(device)}`` keeps working.

  - ``free`` (default): the micro-batch's rows are concatenated into one ``[1, T]`` row, no pad
    token at all. Correct for every attention implementation, flash-attention included.
  - ``longest`` / ``max_length``: ``[B, W]`` padded to the longest row / to ``max_seq_len``;
    pads are a separate position segment with label -100. Rows that hold one sequence each get a
    classic ``attention_mask``. Packed rows in a padded batch rely on position ids, which
    SDPA/eager honour but flash-attention does not for ``B > 1``: use ``free`` with flash.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

IGNORE = -100
CORE_COLUMNS = ("input_ids", "labels", "position_ids")
COUNT_COLUMNS = ("num_tokens", "num_loss_tokens")
PADDING_MODES = ("free", "longest", "max_length")
CACHE_ENV = "CAMPAIGN_DATA_CACHE"


class DatasetMismatch(ValueError):
    pass


# Batch keys the trainer uses itself; every other key of a collated batch goes to model(**batch).
NON_MODEL_KEYS = frozenset({"labels", "real_tokens"})


def loss_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that contribute to the loss (labels are shifted by one inside the loss)."""
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def real_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens in the batch."""
    return int(batch["real_tokens"]) if "real_tokens" in batch else int(batch["attention_mask"].sum())


# --------------------------------------------------------------------------- files and metadata


def parquet_files(path: str | Path) -> list[Path]:
    """Shards of a dataset: a file, a directory of shards, or a dataset directory (its ``train/``)."""
    p = Path(path)
    if p.is_dir() and (p / "train").is_dir():
        p = p / "train"
    files = sorted(p.glob("*.parquet")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(
            f"no tokenized Parquet at {p} (expected *.parquet shards written by the tokenized_dataset stage)"
        )
    return files


def _metadata(file: Path) -> dict[str, str]:
    md = pq.read_schema(file).metadata or {}
    return {k.decode(): v.decode() for k, v in md.items() if k.startswith(b"campaign.")}


def dataset_tokenizer_hash(path: str | Path) -> str | None:
    return _metadata(parquet_files(path)[0]).get("campaign.tokenizer_hash")


def check_tokenizer(dataset_hash: str | None, model_hash: str, dataset: str | Path, model: str | Path) -> None:
    """Raise DatasetMismatch unless the dataset was tokenized with the model's tokenizer."""
    if dataset_hash is None:
        raise DatasetMismatch(
            f"dataset {dataset} records no tokenizer hash (campaign.tokenizer_hash); rebuild it "
            "with the tokenized_dataset stage"
        )
    if dataset_hash != model_hash:
        raise DatasetMismatch(
            f"dataset {dataset} was tokenized with tokenizer {dataset_hash[:12]} but the model {model} has tokenizer "
            f"{model_hash[:12]}; token ids would mean different text. Rebuild the tokenized dataset for this model "
            "(re-materialize tokenized_dataset)"
        )


_IDENTITY_KEYS = (
    "campaign.tokenizer_hash",
    "campaign.max_seq_len",
    "campaign.packing",
    "campaign.dataset_key",
    "campaign.source_hash",
    "campaign.split_name",
)


def _check_same_dataset(files: list[Path], metas: list[dict[str, str]]) -> None:
    for k in _IDENTITY_KEYS:
        values = {m.get(k) for m in metas}
        if len(values) > 1:
            raise DatasetMismatch(
                f"shards of {files[0].parent} come from different datasets ({k} differs: "
                f"{sorted(map(str, values))}); a directory must hold one build's shards only"
            )


# --------------------------------------------------------------------------- memory-mapped rows


def _cache_dir(cache_dir: str | Path | None) -> Path:
    d = Path(cache_dir or os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "campaign-arrow-cache")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _arrow_cache(shard: Path, cache_dir: Path) -> Path:
    """Decode ``shard`` once into an uncompressed Arrow IPC file (one record batch) for mmap."""
    st = shard.stat()
    ident = f"{shard.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    out = cache_dir / f"{shard.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:20]}.arrow"
    if out.exists():
        return out
    table = pq.read_table(shard, columns=[*CORE_COLUMNS, *COUNT_COLUMNS]).combine_chunks()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    os.replace(tmp, out)  # atomic: concurrent ranks write identical content
    return out


class _Shard:
    __slots__ = ("rows", "offsets", "values", "num_tokens", "num_loss_tokens", "_table")

    def __init__(self, ipc: Path):
        table = pa.ipc.open_file(pa.memory_map(str(ipc), "r")).read_all()
        self._table = table  # keeps the mapping alive
        self.rows = table.num_rows
        self.values = {}
        self.offsets = None
        for c in CORE_COLUMNS:
            arr = table.column(c).chunk(0)
            offs = arr.offsets.to_numpy()
            if self.offsets is None:
                self.offsets = offs
            elif not np.array_equal(self.offsets, offs):
                raise DatasetMismatch(f"{ipc}: column {c} is not aligned with input_ids")
            self.values[c] = arr.values.to_numpy(zero_copy_only=True)
        self.num_tokens = table.column("num_tokens").chunk(0).to_numpy(zero_copy_only=True)
        self.num_loss_tokens = table.column("num_loss_tokens").chunk(0).to_numpy(zero_copy_only=True)


class _Column:
    """``dataset["input_ids"][i]``: one column as a read-only sequence of numpy arrays."""

    def __init__(self, ds: TokenizedDataset, name: str):
        self._ds, self._name = ds, name

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i: int) -> np.ndarray:
        return self._ds.row(i)[self._name]


class TokenizedDataset(torch.utils.data.Dataset):
    """Map-style, memory-mapped view of one split's Parquet shards (``path``: shard, directory of
    shards, or dataset directory, whose ``train/`` split is used)."""

    def __init__(
        self,
        path: str | Path,
        cache_dir: str | Path | None = None,
        expect_tokenizer_hash: str | None = None,
        model_dir: str | Path | None = None,
    ):
        self.path = Path(path)
        self._cache_arg = cache_dir
        self.files = parquet_files(path)
        metas = [_metadata(f) for f in self.files]
        _check_same_dataset(self.files, metas)
        self.metadata = metas[0]
        if expect_tokenizer_hash is not None:
            check_tokenizer(
                self.metadata.get("campaign.tokenizer_hash"), expect_tokenizer_hash, path, model_dir or "(model)"
            )
        self.padding = self.metadata.get("campaign.padding", "longest")
        if self.padding not in PADDING_MODES:
            raise DatasetMismatch(f"{self.files[0]}: unknown campaign.padding {self.padding!r}")
        msl = self.metadata.get("campaign.max_seq_len")
        self.max_seq_len = int(msl) if msl else None
        cache = _cache_dir(cache_dir)
        self._shards = [_Shard(_arrow_cache(f, cache)) for f in self.files]
        self._starts = np.cumsum([0] + [s.rows for s in self._shards])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __reduce__(self):
        # DataLoader workers started with "spawn" get the path and re-map the cached files,
        # never a pickled copy of the rows
        return (TokenizedDataset, (self.path, self._cache_arg))

    def _locate(self, i: int) -> tuple[_Shard, int]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        i %= n
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._shards[k], i - int(self._starts[k])

    def row(self, i: int) -> dict[str, np.ndarray]:
        shard, j = self._locate(int(i))
        a, b = shard.offsets[j], shard.offsets[j + 1]
        return {c: shard.values[c][a:b] for c in CORE_COLUMNS}

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in CORE_COLUMNS:
                raise KeyError(f"{key!r}; columns are {CORE_COLUMNS}")
            return _Column(self, key)
        return self.row(key)

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([s.num_tokens for s in self._shards]).astype(np.int64)

    @property
    def loss_tokens(self) -> int:
        return int(sum(int(s.num_loss_tokens.sum()) for s in self._shards))

    @property
    def total_tokens(self) -> int:
        return int(sum(int(s.num_tokens.sum()) for s in self._shards))


def load_rows(path: str | Path, cache_dir: str | Path | None = None) -> TokenizedDataset:
    """The dataset for ``collate`` (``rows["input_ids"][i]`` and ``len(rows["input_ids"])`` work)."""
    return TokenizedDataset(path, cache_dir=cache_dir)


# --------------------------------------------------------------------------- batch plan


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass(frozen=True)
class BatchPlan:
    rows: int
    micro_batch: int
    world: int
    accumulation: int
    seed: int

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError("the dataset has no rows")
        if min(self.micro_batch, self.world, self.accumulation) < 1:
            raise ValueError("micro_batch, world and accumulation must be ≥ 1")

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.world * self.accumulation

    def steps_per_epoch(self) -> int:
        """Whole steps in one pass (steps may straddle epochs, so an epoch is rows/rows_per_step steps)."""
        return max(1, self.rows // self.rows_per_step)

    def order(self, epoch: int) -> list[int]:
        return _permutation(self.rows, self.seed, epoch).tolist()

    def positions(self, start: int, count: int) -> list[int]:
        """Row indices at stream positions ``[start, start + count)`` (epochs laid end to end)."""
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, off = divmod(pos, self.rows)
            take = min(end - pos, self.rows - off)
            out += _permutation(self.rows, self.seed, epoch)[off : off + take].tolist()
            pos += take
        return out

    def epoch_at(self, step: int) -> float:
        return step * self.rows_per_step / self.rows

    def step_rows(self, step: int, rank: int) -> list[list[int]]:
        """Row indices of each accumulation micro-batch of global ``step`` for ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world {self.world}")
        base = step * self.rows_per_step
        return [
            self.positions(base + (a * self.world + rank) * self.micro_batch, self.micro_batch)
            for a in range(self.accumulation)
        ]


def iter_steps(plan: BatchPlan, start: int, stop: int, rank: int) -> Iterator[tuple[int, list[list[int]]]]:
    for step in range(start, stop):
        yield step, plan.step_rows(step, rank)


# --------------------------------------------------------------------------- collation


def _gather(rows, idx: Sequence[int]) -> list[dict[str, np.ndarray]]:
    if isinstance(rows, TokenizedDataset):
        return [rows.row(i) for i in idx]
    # a plain dict of lists (tests, older callers)
    return [{c: np.asarray(rows[c][i], dtype=np.int64) for c in CORE_COLUMNS} for i in idx]


def _single_sequence(pos: np.ndarray) -> bool:
    return bool(pos.size == 0 or (pos[0] == 0 and np.all(np.diff(pos) == 1)))


def collate(
    rows, idx: Sequence[int], pad_id: int, padding: str | None = None, max_seq_len: int | None = None
) -> dict[str, torch.Tensor]:
    """Model inputs for rows ``idx``: ``input_ids``, ``position_ids`` (+ ``attention_mask`` for
    padded single-sequence rows), and for the trainer ``labels`` and ``real_tokens``.

    ``padding`` defaults to the dataset's own setting (``free`` for datasets built by the
    tokenized_dataset stage; ``longest`` for a plain dict of lists)."""
    mode = padding or getattr(rows, "padding", "longest")
    if mode not in PADDING_MODES:
        raise ValueError(f"padding must be one of {PADDING_MODES}, got {mode!r}")
    seqs = _gather(rows, idx)
    if not seqs:
        raise ValueError("collate needs at least one row")
    real = sum(len(s["input_ids"]) for s in seqs)
    if mode == "free":
        out = {
            c: torch.from_numpy(np.concatenate([s[c] for s in seqs]).astype(np.int64)).unsqueeze(0)
            for c in CORE_COLUMNS
        }
        out["real_tokens"] = torch.tensor(real)
        out["use_cache"] = torch.tensor(False)
        return out
    longest = max(len(s["input_ids"]) for s in seqs)
    width = longest
    if mode == "max_length":
        width = max(longest, max_seq_len or getattr(rows, "max_seq_len", None) or longest)
    n = len(seqs)
    ids = np.full((n, width), pad_id, dtype=np.int64)
    labels = np.full((n, width), IGNORE, dtype=np.int64)
    pos = np.tile(np.arange(width, dtype=np.int64), (n, 1))
    mask = np.zeros((n, width), dtype=np.int64)
    single = True
    for j, s in enumerate(seqs):
        k = len(s["input_ids"])
        ids[j, :k] = s["input_ids"]
        labels[j, :k] = s["labels"]
        pos[j, :k] = s["position_ids"]
        pos[j, k:] = np.arange(width - k)  # pads: their own segment, never attended by real tokens
        mask[j, :k] = 1
        single = single and _single_sequence(s["position_ids"])
    out = {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(pos),
        "real_tokens": torch.tensor(real),
        "use_cache": torch.tensor(False),
    }
    if single:
        out["attention_mask"] = torch.from_numpy(mask)
    return out


# --------------------------------------------------------------------------- iterable stream


class StepStream(torch.utils.data.IterableDataset):
    """Collated micro-batches of ``rank`` for steps ``[start, stop)``, in step order.

    Yields ``(step, [batch per accumulation micro-step])``. Use with
    ``DataLoader(stream, batch_size=None, num_workers=W)``; each worker builds every W-th step and
    the DataLoader's round-robin over workers returns them in order. Resume by building the
    stream with ``start`` = the saved global step (``state_dict``/``load_state_dict`` carry it).
    """

    def __init__(
        self, dataset, plan: BatchPlan, rank: int, start: int, stop: int, pad_id: int, padding: str | None = None
    ):
        super().__init__()
        self.dataset, self.plan, self.rank = dataset, plan, rank
        self.start, self.stop, self.pad_id, self.padding = start, stop, pad_id, padding

    def __iter__(self) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for step in range(self.start + wid, self.stop, nw):
            yield (
                step,
                [collate(self.dataset, idx, self.pad_id, self.padding) for idx in self.plan.step_rows(step, self.rank)],
            )

    def state_dict(self) -> dict:
        return {"step": self.start, "plan": json.dumps(self.plan.__dict__, sort_keys=True)}

    def load_state_dict(self, state: dict, consumed_step: int | None = None) -> None:
        """Continue after ``consumed_step`` (or from ``state['step']``); the plan must match."""
        if state.get("plan") and state["plan"] != json.dumps(self.plan.__dict__, sort_keys=True):
            raise DatasetMismatch(
                f"saved data position was for batch plan {state['plan']}, not "
                f"{json.dumps(self.plan.__dict__, sort_keys=True)}; the dataset or batch "
                "settings changed since the checkpoint"
            )
        self.start = consumed_step + 1 if consumed_step is not None else int(state["step"])


def make_loader(
    dataset,
    plan: BatchPlan,
    rank: int,
    start: int,
    stop: int,
    pad_id: int,
    num_workers: int = 0,
    padding: str | None = None,
) -> torch.utils.data.DataLoader:
    """A DataLoader over ``StepStream`` (``num_workers`` background processes build batches)."""
    stream = StepStream(dataset, plan, rank, start, stop, pad_id, padding)
    return torch.utils.data.DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=False,
        prefetch_factor=4 if num_workers else None,
    )
