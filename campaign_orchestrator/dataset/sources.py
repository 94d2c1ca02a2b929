"""Read prompt/completion or conversational data with ``datasets``, in any of its file formats.

A source is a path: a ``.jsonl``/``.json``, ``.parquet`` or ``.csv`` file, a glob of such files,
or a directory written by ``Dataset.save_to_disk``. Each source is loaded with ``datasets``
(``load_dataset("json" | "parquet" | "csv", data_files=...)`` or ``load_from_disk``), its
Arrow cache kept in a work directory the caller deletes, never in the user's home. Parquet, and
JSON Lines of flat values, take a shortcut to the same memory-mapped ``Dataset``: pyarrow's
multi-threaded readers write the Arrow cache file directly (``load_dataset``'s JSON builder
parses every line in Python to detect mixed types, several times slower; anything pyarrow refuses, such
as mixed-type JSON values, still goes through ``load_dataset``).

Columns: ``prompt`` and ``completion`` (strings), or ``messages`` (list of ``{role, content}``);
``id`` (string) is optional: without it, ids are ``<source name>:<row number>``. Example ids
must be unique across sources (the train/validation split and the per-row provenance use them).
``completion_token_ids`` and ``top_logprobs`` (a teacher generation's, ``campaign_orchestrator/generation/rows.py``)
are kept when present, for logit distillation (``campaign_orchestrator.dataset.topk``).
"""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from pathlib import Path

from campaign_orchestrator.content import dir_sha256, file_sha256
from campaign_orchestrator.dataset.topk import SOURCE_COLUMNS
from campaign_orchestrator.dataset.xtok import XTOK_SOURCE_COLUMNS

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class SourceError(ValueError):
    """A source that cannot be read as training data (names the file and the expected form)."""


@dataclass(frozen=True)
class Source:
    name: str
    files: tuple[Path, ...]  # data files, or the saved dataset directory
    kind: str  # json | parquet | csv | saved


def resolve_source(path: str | Path, base_dir: str | Path | None = None) -> Source:
    """Find the files behind ``path`` (relative paths are relative to ``base_dir``)."""
    raw = str(path)
    p = Path(raw)
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    if p.is_dir():
        if (p / "dataset_info.json").exists() or (p / "state.json").exists():
            return Source(p.name, (p,), "saved")
        files = sorted(f for f in p.iterdir() if f.suffix in BUILDERS)
    elif any(ch in raw for ch in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(p)))
    else:
        files = [p]
    if not files:
        raise SourceError(
            f"data source {raw!r}: no files found at {p} (expected .jsonl, .json, .parquet, .csv files, "
            "a glob of them, or a directory saved with Dataset.save_to_disk)"
        )
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise SourceError(f"data source {raw!r}: {missing[0]} does not exist")
    kinds = {BUILDERS.get(f.suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise SourceError(
            f"data source {raw!r}: files must all be one of {sorted(BUILDERS)}, got "
            f"{sorted({f.suffix or f.name for f in files})}"
        )
    name = p.stem if len(files) == 1 else p.parent.name or p.name
    return Source(name, tuple(files), kinds.pop())


def source_hash(sources: list[Source]) -> str:
    """Content hash of every source (file bytes, or the saved dataset directory)."""
    h = hashlib.sha256()
    for s in sources:
        for f in s.files:
            h.update((dir_sha256(f) if f.is_dir() else file_sha256(f)).encode())
    return h.hexdigest()


def _empty_file(f: Path, kind: str) -> bool:
    if f.is_dir():
        return False
    if f.stat().st_size == 0:
        return True
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(f).metadata.num_rows == 0
    return False


def _read_arrow(src: Source, files: list[Path], cache_dir: Path):
    """Parquet files, and JSON Lines files of flat values, read straight with pyarrow's
    multi-threaded readers into one memory-mapped Arrow file (what ``load_dataset`` builds, at a
    fraction of its cost); None for anything else (a JSON array, nested or mixed-type JSON values,
    Parquet written by ``datasets`` with its own features), which ``load_dataset`` then reads with
    its own conversions."""
    import datasets
    import pyarrow as pa

    if src.kind not in ("json", "parquet"):
        return None
    try:
        if src.kind == "json":
            import pyarrow.json as pajson

            tables = [pajson.read_json(str(f)) for f in files]
        else:
            import pyarrow.parquet as pq

            tables = [pq.read_table(f) for f in files]
        table = pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowException, ValueError, OSError):
        return None
    flat = all(
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_null(t)
        or pa.types.is_boolean(t)
        for t in table.schema.types
    )
    if src.kind == "json" and not flat:  # JSON needs load_dataset's handling of nested and mixed values
        return None
    if b"huggingface" in (table.schema.metadata or {}):  # datasets' own features (images, class labels, ...)
        return None
    table = table.replace_schema_metadata(None)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1("|".join(f"{f.resolve()}:{f.stat().st_mtime_ns}" for f in files).encode()).hexdigest()
    path = cache_dir / f"source-{key[:16]}.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=10_000)
    return datasets.Dataset.from_file(str(path))


def load_source(src: Source, cache_dir: str | Path):
    """The source as a ``datasets.Dataset`` with columns ``id`` plus ``prompt``/``completion`` or
    ``messages``. Raises SourceError for an unreadable file or missing columns."""
    import datasets

    files = [f for f in src.files if not _empty_file(f, src.kind)]  # datasets fails on 0-byte / 0-row files
    if not files:
        raise SourceError(f"data source {', '.join(map(str, src.files))}: the input is empty (0 bytes, no examples)")
    try:
        if src.kind == "saved":
            ds = datasets.load_from_disk(str(src.files[0]))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise SourceError(
                        f"data source {src.files[0]}: a DatasetDict without a 'train' split (splits: {sorted(ds)})"
                    )
                ds = ds["train"]
        else:
            ds = _read_arrow(src, files, Path(cache_dir))
            if ds is None:
                ds = datasets.load_dataset(
                    src.kind, data_files=[str(f) for f in files], split="train", cache_dir=str(cache_dir)
                )
    except SourceError:
        raise
    except Exception as e:  # noqa: BLE001 - name the file in the error users see
        raise SourceError(
            f"data source {', '.join(map(str, src.files))}: could not be read as {src.kind}: "
            f"{type(e).__name__}: {str(e)[:300]}"
        ) from e
    cols = set(ds.column_names)
    if "messages" in cols:
        keep = ["messages"]
    elif {"prompt", "completion"} <= cols:
        keep = ["prompt", "completion"]
    else:
        raise SourceError(
            f"data source {', '.join(map(str, src.files))}: expected columns `prompt` and `completion` "
            f"(strings) or `messages` (list of {{role, content}}); found {sorted(cols)}"
        )
    # the teacher's generated ids and top-k log-probabilities (logit distillation), an API teacher's tokens as text
    # and which teacher answered (cross-tokenizer: campaign_orchestrator.dataset.xtok), when the source has them
    keep += [c for c in (*SOURCE_COLUMNS, *XTOK_SOURCE_COLUMNS) if c in cols]
    if "id" in cols:
        ds = ds.select_columns(["id", *keep])
        if ds.features["id"].dtype not in ("string", "large_string"):
            ds = ds.cast_column("id", datasets.Value("string"))
    else:
        name = src.name
        ds = ds.select_columns(keep).map(
            lambda _b, idx: {"id": [f"{name}:{i}" for i in idx]},
            batched=True,
            with_indices=True,
            cache_file_name=None
            if src.kind != "saved"
            else str(Path(cache_dir) / f"ids-{hashlib.sha1(name.encode()).hexdigest()}.arrow"),
        )
    return ds
