"""The content-addressed generation cache: a generation is paid for once, whatever happens.

Layout on the storage (a local directory by default, ``s3://bucket/prefix`` through boto3)::

    generations/<namespace>/shard-<time>-<id>.parquet     sealed shards (CACHE_SCHEMA)

``namespace`` is the hash of the teacher identity and sampling parameters
(:func:`campaign_orchestrator.teacher.requests.namespace`); every row carries its full request key. The cache
lives outside the per-campaign stage directories, so identical requests from other campaigns
and re-runs are found there.

Writing survives a crash or a kill. Each finished generation is appended at once to a local
*spool* file (JSON lines, flushed per row, so it survives SIGKILL of the process; not a power
cut: no fsync) that the writer holds an exclusive ``flock`` on. Every ``shard_rows`` rows or
``shard_seconds`` seconds the spool is sealed into a Parquet shard on the store and emptied.
A spool whose writer died (its lock is free) is sealed by the next process that opens the same
namespace, so a killed run loses only the requests that were in flight. A spool is locked before it
takes the name recovery looks for (created as ``<id>.opening``, then renamed), so a recovery running
beside a live writer never takes its new, still empty spool for a dead writer's. Errors are never
cached: a failed request is asked again on the next run.

Two writers may race on the same request; the cache then holds two rows with one key and
readers take the first (shards sort by time), so the dataset still has one row per request.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from campaign_orchestrator.generation.blobstore import BlobStore
from campaign_orchestrator.generation.rows import TOP_LOGPROBS_TYPE, logprobs_to_arrow

CACHE_SCHEMA = pa.schema(
    [
        ("key", pa.string()),  # request key (campaign_orchestrator.teacher.requests.request_key)
        ("input", pa.string()),  # the prompt text, or the chat messages as JSON
        ("sample_index", pa.int32()),
        ("completion", pa.string()),
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("latency_s", pa.float64()),
        ("retries", pa.int32()),
        ("top_logprobs", TOP_LOGPROBS_TYPE),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("backend", pa.string()),
        ("model", pa.string()),
        ("teacher_identity", pa.string()),
        ("created_at", pa.float64()),  # unix time the generation finished
    ]
)

PREFIX = "generations"


class CacheError(RuntimeError):
    pass


def _table_bytes(rows: list[dict]) -> bytes:
    rows = [r | {"top_logprobs": logprobs_to_arrow(r.get("top_logprobs"))} for r in rows]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=CACHE_SCHEMA), buf)
    return buf.getvalue()


OPENING = ".opening"  # a spool being created: not yet locked, never recovered (CacheWriter._open_spool)


def _unlink_if_stale(path: Path, age_s: float = 3600.0) -> None:
    """Remove an unnamed spool older than ``age_s``: its writer was killed between creating and naming it (it
    holds no rows). A younger one may belong to a writer about to lock it: left alone."""
    try:
        if time.time() - path.stat().st_mtime > age_s:
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def _read_spool(path: Path) -> list[dict]:
    """Rows of a spool file; a torn last line (killed mid-write) is skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows


class GenerationCache:
    """One namespace of the cache on ``store``; spools live in ``spool_dir`` (local disk)."""

    def __init__(self, store: BlobStore, namespace: str, spool_dir: str | Path, shard_rows: int = 256,
                 shard_seconds: float = 15.0, max_shards: int = 64):
        self.store, self.namespace = store, namespace
        self.prefix = f"{PREFIX}/{namespace}/"
        self.spool_dir = Path(spool_dir) / namespace
        self.shard_rows, self.shard_seconds, self.max_shards = shard_rows, shard_seconds, max_shards
        self.recovered_rows = 0

    # ------------------------------------------------------------------ reading

    def shards(self) -> list[str]:
        return [k for k in self.store.list(self.prefix) if k.endswith(".parquet")]

    def _read_shard(self, key: str) -> pa.Table:
        try:
            return pq.read_table(io.BytesIO(self.store.get(key)))
        except (OSError, pa.ArrowInvalid) as e:
            raise CacheError(f"generation cache shard {self.store.url}/{key} is unreadable ({e}); delete it to "
                             f"regenerate its rows") from e

    def lookup(self, keys: Iterable[str]) -> dict[str, dict]:
        """Cached rows for the given request keys (missing keys are absent)."""
        wanted = pa.array(sorted(set(keys)), pa.string())
        found: dict[str, dict] = {}
        if len(wanted) == 0:
            return found
        for shard in self.shards():
            try:
                pf = pq.ParquetFile(io.BytesIO(self.store.get(shard)))
                keys = pf.read(columns=["key"])["key"]
                hit = pc.is_in(keys, value_set=wanted)
                if not pc.any(hit).as_py():
                    continue  # only the key column was decoded
                t = pf.read().filter(hit)
            except (OSError, pa.ArrowInvalid) as e:
                raise CacheError(f"generation cache shard {self.store.url}/{shard} is unreadable ({e}); delete it "
                                 f"to regenerate its rows") from e
            for row in t.to_pylist():
                found.setdefault(row["key"], row)
        return found

    def __len__(self) -> int:
        return len({k for s in self.shards() for k in self._read_shard(s)["key"].to_pylist()})

    # ------------------------------------------------------------------ recovery, compaction

    def recover(self) -> int:
        """Seal spool files left by writers that died; returns the rows recovered."""
        n = 0
        if not self.spool_dir.is_dir():
            return 0
        for path in sorted(self.spool_dir.glob(f"*{OPENING}")):  # a writer killed before it named its spool
            _unlink_if_stale(path)
        for path in sorted(self.spool_dir.glob("*.jsonl")):
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # sealed by its writer or another recoverer since the listing
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer owns it
                if os.fstat(fd).st_nlink == 0:
                    continue  # sealed and removed between our open and our lock: its rows are in a shard
                rows = _read_spool(path)
                if rows:
                    self._put_shard(rows)
                    n += len(rows)
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        self.recovered_rows += n
        return n

    def _put_shard(self, rows: list[dict]) -> str:
        key = f"{self.prefix}shard-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet"
        self.store.put(key, _table_bytes(rows))
        return key

    def compact(self) -> int:
        """Merge the shards into one when there are more than ``max_shards``; returns shards merged."""
        shards = self.shards()
        if len(shards) <= self.max_shards:
            return 0
        seen: set[str] = set()
        rows = []
        for s in shards:
            for r in self._read_shard(s).to_pylist():
                if r["key"] not in seen:
                    seen.add(r["key"])
                    rows.append(r)
        self._put_shard(rows)  # written before the old ones go: a reader never misses a row
        for s in shards:
            self.store.delete(s)
        return len(shards)

    # ------------------------------------------------------------------ writing

    def writer(self) -> CacheWriter:
        return CacheWriter(self)


class CacheWriter:
    """Append finished generations; sealed into shards in a background thread."""

    def __init__(self, cache: GenerationCache):
        self.cache = cache
        cache.spool_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cache-seal")
        self._pending: list[Future] = []
        self._file = None
        self._count = 0
        self._since = 0.0
        self.rows_written = 0
        self.shards_written = 0
        self._open_spool()

    def _open_spool(self) -> None:
        """A new spool, locked before it gets the name recovery looks for: created and locked as
        ``<id>.opening`` then renamed (the lock stays with the file), so a recoverer can never find it
        unlocked, take it for a dead writer's and remove it under this writer."""
        name = uuid.uuid4().hex
        opening, path = self.cache.spool_dir / f"{name}{OPENING}", self.cache.spool_dir / f"{name}.jsonl"
        f = open(opening, "a", encoding="utf-8")
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        os.rename(opening, path)
        self._file, self._path, self._count = f, path, 0

    def add(self, row: dict) -> None:
        line = json.dumps(row, ensure_ascii=False) + "\n"
        with self._lock:
            if self._file is None:
                raise CacheError("cache writer is closed")
            self._file.write(line)
            self._file.flush()  # in the kernel now: survives SIGKILL of this process
            self.rows_written += 1
            if self._count == 0:
                self._since = time.monotonic()
            self._count += 1
            if self._count >= self.cache.shard_rows or time.monotonic() - self._since >= self.cache.shard_seconds:
                self._rotate()

    def _rotate(self) -> None:
        f, path, count = self._file, self._path, self._count
        self._open_spool()
        if count:
            self._pending.append(self._pool.submit(self._seal, f, path))
        else:
            self._discard(f, path)

    def _seal(self, f, path: Path) -> None:
        try:
            rows = _read_spool(path)
            if rows:
                self.cache._put_shard(rows)
                self.shards_written += 1
            path.unlink(missing_ok=True)
        finally:
            f.close()  # releases the lock: if the upload failed, the next run recovers the spool

    @staticmethod
    def _discard(f, path: Path) -> None:
        path.unlink(missing_ok=True)
        f.close()

    def close(self) -> None:
        """Seal what is spooled and wait for every shard upload; raises if one failed (the
        rows stay in the local spool and are uploaded by the next run)."""
        with self._lock:
            if self._file is None:
                return
            f, path, count = self._file, self._path, self._count
            self._file = None
            if count:
                self._pending.append(self._pool.submit(self._seal, f, path))
            else:
                self._discard(f, path)
        self._pool.shutdown(wait=True)
        errors = [e for e in (p.exception() for p in self._pending) if e is not None]
        if errors:
            raise CacheError(f"{len(errors)} cache shard(s) could not be written to {self.cache.store.url} "
                             f"(first: {errors[0]}); their rows are kept in {self.cache.spool_dir} and are "
                             f"written by the next run") from errors[0]

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
