"""The teacher generation table: one row per (prompt, sample), written as Parquet."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

GENERATION_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("sample_index", pa.int32()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("latency_s", pa.float64()),
        ("backend", pa.string()),
        ("model", pa.string()),
        ("sampling_hash", pa.string()),
        ("error", pa.string()),
    ]
)


def write_generations(rows: list[dict], path: str | Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA), path)
    return Path(path)


def read_generations(path: str | Path) -> list[dict]:
    return pq.read_table(path).to_pylist()
