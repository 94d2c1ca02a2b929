"""Read the pre-tokenized Parquet dataset and cut it into per-rank micro-batches.

Every optimizer step takes ``micro_batch × world × accumulation`` rows from a seeded
per-epoch permutation; rank ``r`` takes micro-batch ``a`` from the slice
``[(a·world + r)·micro, ...)``, so ranks never overlap and the global batch is the same
whatever the world size (that is what makes multi-rank runs comparable to one process).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch


class DatasetMismatch(ValueError):
    pass


# Batch keys the trainer uses itself; every other key of a collated batch goes to model(**batch).
NON_MODEL_KEYS = frozenset({"labels", "real_tokens"})


def loss_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that contribute to the loss (labels are shifted by one inside the loss)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def real_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens in the batch."""
    return int(batch["real_tokens"]) if "real_tokens" in batch else int(batch["attention_mask"].sum())


def parquet_files(path: str | Path) -> list[Path]:
    p = Path(path)
    files = sorted(p.glob("*.parquet")) if p.is_dir() else [p]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no tokenized Parquet at {p}")
    return files


def load_rows(path: str | Path) -> dict[str, list]:
    files = parquet_files(path)
    cols = ["input_ids", "labels", "position_ids", "num_loss_tokens"]
    out: dict[str, list] = {c: [] for c in cols}
    for f in files:
        t = pq.read_table(f, columns=cols, memory_map=True)
        for c in cols:
            out[c] += t.column(c).to_pylist()
    return out


def dataset_tokenizer_hash(path: str | Path) -> str | None:
    md = pq.read_schema(parquet_files(path)[0]).metadata or {}
    v = md.get(b"campaign.tokenizer_hash")
    return v.decode() if v else None


@dataclass(frozen=True)
class BatchPlan:
    rows: int
    micro_batch: int
    world: int
    accumulation: int
    seed: int

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.world * self.accumulation

    def steps_per_epoch(self) -> int:
        return max(1, self.rows // self.rows_per_step)

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.rows, generator=g).tolist()

    def step_rows(self, step: int, rank: int) -> list[list[int]]:
        """Row indices of each accumulation micro-batch of global ``step`` for ``rank``."""
        spe = self.steps_per_epoch()
        order = self.order(step // spe)
        base = (step % spe) * self.rows_per_step
        out = []
        for a in range(self.accumulation):
            start = base + (a * self.world + rank) * self.micro_batch
            out.append(order[start : start + self.micro_batch])
        return out


def collate(rows: dict[str, list], idx: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(rows["input_ids"][i]) for i in idx)
    n = len(idx)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for j, i in enumerate(idx):
        k = len(rows["input_ids"][i])
        ids[j, :k] = torch.tensor(rows["input_ids"][i])
        labels[j, :k] = torch.tensor(rows["labels"][i])
        pos[j, :k] = torch.tensor(rows["position_ids"][i])
        mask[j, :k] = 1
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask}


def iter_steps(plan: BatchPlan, start: int, stop: int, rank: int) -> Iterator[tuple[int, list[list[int]]]]:
    for step in range(start, stop):
        yield step, plan.step_rows(step, rank)
