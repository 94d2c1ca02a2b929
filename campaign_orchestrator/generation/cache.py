"""The content-addressed generation cache: a generation is paid for once, whatever happens.

Layout on the storage (a local directory by default, ``s3://bucket/prefix`` through boto3)::

    generations/<namespace>/[<d>/<d>/...]shard-<time>-<id>-k<first>-<last>-n<rows>.parquet   sealed spools
    generations/<namespace>/[<d>/<d>/...]run-<time>-<run>-<part>-k<first>-<last>-n<rows>.parquet   compacted

Every file holds CACHE_SCHEMA rows sorted by key; its name carries its key range (``<first>``/``<last>``: hex of
the first bytes of its smallest and largest key) and it lives in the folder of the hex digits those keys share
(``<d>``, at most DIR_DEPTH levels). So a lookup costs what it asks for, not what the cache holds: it lists only
its key range's folders, skips files by the range in their names, and in the rest reads the footer and only the
row groups whose key statistics can hold a wanted key (:meth:`GenerationCache.lookup`). Compaction streams with
memory bounded by one key range of ``run_bytes`` (:func:`merge_files`). Why this layout, not a key index or hash
partitions, and what ``benchmarks/generation_cache.py`` measures of it: docs/teacher.md ("How the cache scales").

``namespace`` is the hash of the teacher identity and sampling parameters
(:func:`campaign_orchestrator.generation.requests.namespace`); every row carries its full request key. The cache
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
readers (and compaction) take the first written (``created_at``, then file time), so the dataset still has one
row per request.
"""

from __future__ import annotations

import bisect
import fcntl
import io
import json
import math
import os
import re
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from campaign_orchestrator.generation.blobstore import BlobStore, MissingObject
from campaign_orchestrator.generation.rows import TOP_LOGPROBS_TYPE, logprobs_to_arrow

CACHE_SCHEMA = pa.schema(
    [
        ("key", pa.string()),  # request key (campaign_orchestrator.generation.requests.request_key)
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
        ("completion_token_strings", pa.list_(pa.string())),  # HTTP teachers with top-k (generation/rows.py)
    ]
)


def _conform(t: pa.Table) -> pa.Table:
    """``t`` with CACHE_SCHEMA's columns in its order: a column added to the schema after a file was written is
    read as nulls (older files lack it)."""
    for f in CACHE_SCHEMA:
        if f.name not in t.column_names:
            t = t.append_column(f, pa.nulls(len(t), f.type))
    return t.select(CACHE_SCHEMA.names).cast(CACHE_SCHEMA)


PREFIX = "generations"


class CacheError(RuntimeError):
    pass


ROW_GROUP_ROWS = 4096  # at most this many rows per Parquet row group (what a lookup reads once it has a candidate)
ROW_GROUP_BYTES = 1 << 20  # and about this many bytes: rows with many top-k log-probabilities get smaller groups
RUN_BYTES = 8 << 20  # uncompressed bytes per file of a compacted run: what compaction holds in memory at once
FOOTER_BYTES = 128 << 10  # the tail a remote lookup fetches in its first GET (the footer, all of a small file)
KEY_PREFIX_BYTES = 12  # of a file's first and last key, kept in its name
_MAX_KEY = "\U0010ffff"  # sorts after any key (request keys are hex digests)


def _write(t: pa.Table, where) -> None:
    """A cache file: row groups of at most ROW_GROUP_ROWS rows and about ROW_GROUP_BYTES, statistics on the key
    column only (lookups prune by them; the footer stays small)."""
    per_row = max(1, t.nbytes // max(1, len(t)))
    rows = max(16, min(ROW_GROUP_ROWS, ROW_GROUP_BYTES // per_row))
    pq.write_table(t, where, row_group_size=rows, write_statistics=["key"])


def _table_bytes(rows: list[dict]) -> bytes:
    rows = [r | {"top_logprobs": logprobs_to_arrow(r.get("top_logprobs"))} for r in rows]
    buf = io.BytesIO()
    _write(pa.Table.from_pylist(rows, schema=CACHE_SCHEMA), buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- file names
# shard-<time>-<id>-k<first>-<last>-n<rows>.parquet          a sealed spool, sorted by key
# run-<time>-<run>-<part>-k<first>-<last>-n<rows>.parquet     one key range of a compacted run, sorted by key
# shard-<time>-<id>.parquet                                   written before files were sorted: read whole
# <first>/<last>: hex of the first KEY_PREFIX_BYTES bytes of the file's smallest and largest key.

_NAME = re.compile(
    r"^(?P<kind>shard|run)-(?P<time>\d{20})-(?P<id>[0-9a-f]{8})(?:-(?P<part>\d{4}))?"
    r"(?:-k(?P<lo>[0-9a-f]*)-(?P<hi>[0-9a-f]*)-n(?P<rows>\d+))?\.parquet$"
)


DIR_DEPTH = 4  # folder levels: a file lives under the hex digits its first and last key share, at most this many
_HEX = frozenset("0123456789abcdef")


def _shared_hex(a: str, b: str, depth: int = DIR_DEPTH) -> str:
    """The leading hex digits ``a`` and ``b`` share (at most ``depth``)."""
    n = 0
    while n < min(depth, len(a), len(b)) and a[n] == b[n] and a[n] in _HEX:
        n += 1
    return a[:n]


def _folder(digits: str) -> str:
    """``"ab1"`` -> ``"a/b/1/"``: the folder of files whose keys all start with those digits."""
    return "".join(f"{c}/" for c in digits)


def _prefix_hex(key: str) -> str:
    return key.encode("utf-8")[:KEY_PREFIX_BYTES].hex()


def _unhex(h: str) -> str:
    return bytes.fromhex(h).decode("utf-8", "ignore")  # a character cut in two is dropped: still a prefix


def shard_name(
    kind: str, first: str, last: str, rows: int, run: str | None = None, part: int = 0, t_ns: int | None = None
) -> str:
    """A file name carrying its kind, time, key range and row count (:func:`parse_name` reads it)."""
    t = f"{(t_ns if t_ns is not None else time.time_ns()):020d}"
    ident = f"{run}-{part:04d}" if kind == "run" else uuid.uuid4().hex[:8]
    return f"{kind}-{t}-{ident}-k{_prefix_hex(first)}-{_prefix_hex(last)}-n{rows}.parquet"


@dataclass(frozen=True)
class CacheFile:
    """One Parquet file of a namespace, as its name describes it."""

    key: str  # the store key
    name: str
    kind: str  # shard | run
    time: int  # ns: the seal time (a run: its oldest input's)
    run: str | None = None
    lo: str | None = None  # a prefix of its smallest key (None: unknown, a file from before names held it)
    hi: str | None = None  # a prefix of its largest key
    rows: int | None = None

    def candidates(self, wanted: list[str]) -> list[str]:
        """The keys of sorted ``wanted`` this file can hold (by the key range in its name)."""
        if self.lo is None:
            return wanted
        return wanted[bisect.bisect_left(wanted, self.lo) : bisect.bisect_right(wanted, self.hi + _MAX_KEY)]


def parse_name(key: str) -> CacheFile | None:
    name = key.rsplit("/", 1)[-1]
    m = _NAME.match(name)
    if m is None:
        return None
    ranged = m["lo"] is not None
    return CacheFile(
        key,
        name,
        m["kind"],
        int(m["time"]),
        m["id"] if m["kind"] == "run" else None,
        _unhex(m["lo"]) if ranged else None,
        _unhex(m["hi"]) if ranged else None,
        int(m["rows"]) if ranged else None,
    )


# ---------------------------------------------------------------------------------------------- reading parts

_FOOTERS: OrderedDict = OrderedDict()  # (store url, key) -> (FileMetaData, size); files never change once written
_FOOTERS_MAX = 4096
_FOOTERS_LOCK = threading.Lock()


def _metadata(url: str, key: str, src) -> pq.FileMetaData:
    k = (url, key)
    with _FOOTERS_LOCK:
        hit = _FOOTERS.get(k)
        if hit is not None:
            _FOOTERS.move_to_end(k)
            return hit[0]
    md = pq.read_metadata(src)
    with _FOOTERS_LOCK:
        _FOOTERS[k] = (md, getattr(src, "size", None))
        while len(_FOOTERS) > _FOOTERS_MAX:
            _FOOTERS.popitem(last=False)
    return md


def _key_column(md: pq.FileMetaData) -> int:
    for i in range(md.num_columns):
        if md.schema.column(i).path == "key":
            return i
    raise pa.ArrowInvalid("no `key` column")


def _may_hold(col, cand: list[str]) -> bool:
    """Whether a row group whose key statistics are ``col``'s can hold a key of sorted ``cand``."""
    st = col.statistics
    if st is None or not st.has_min_max:
        return True
    lo, hi = st.min, st.max
    lo, hi = (x.decode("utf-8", "ignore") if isinstance(x, bytes) else x for x in (lo, hi))
    return bisect.bisect_left(cand, lo) < bisect.bisect_right(cand, hi + _MAX_KEY)


def _span(rg, columns) -> tuple[int, int]:
    """The byte range holding ``columns`` of row group ``rg`` (column chunks of a row group are contiguous)."""
    start, end = None, 0
    for j in columns:
        c = rg.column(j)
        s0 = c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset
        start = s0 if start is None else min(start, s0)
        end = max(end, s0 + c.total_compressed_size)
    return start or 0, end


class _RangedFile(io.RawIOBase):
    """A read-only, seekable view of a remote object for pyarrow: reads come from the blocks fetched so far (the
    tail, and the spans :meth:`prefetch` asked for in one GET each) or else from a ranged GET of their own."""

    def __init__(self, store: BlobStore, key: str, size: int, tail: bytes):
        super().__init__()
        self.store, self.key, self.size, self.pos = store, key, size, 0
        self.blocks: list[tuple[int, bytes]] = [(size - len(tail), tail)]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos

    def prefetch(self, start: int, end: int) -> None:
        if not self._cached(start, end):
            self.blocks = self.blocks[:1] + [(start, self.store.read_range(self.key, start, end))]

    def _cached(self, start: int, end: int) -> bytes | None:
        for s0, data in self.blocks:
            if s0 <= start and end <= s0 + len(data):
                return data[start - s0 : end - s0]
        return None

    def readinto(self, b) -> int:
        end = min(self.size, self.pos + len(b))
        if end <= self.pos:
            return 0
        data = self._cached(self.pos, end)
        if data is None:
            data = self.store.read_range(self.key, self.pos, end)
        n = len(data)
        b[:n] = data
        self.pos += n
        return n


# ---------------------------------------------------------------------------------------------- compaction


def merge_files(cache: GenerationCache, inputs: list[CacheFile], run_bytes: int = RUN_BYTES) -> list[str]:
    """Merge ``inputs`` (oldest first) into one compacted run, streaming, with memory bounded by ``run_bytes``
    whatever their total. Remote inputs are downloaded to a temporary directory first (disk, not memory).

    1. A sample of every ``step``-th key gives the run's key-range boundaries: ``parts`` ranges of about
       ``run_bytes`` uncompressed bytes each.
    2. Each input is read a row group at a time and its rows appended to their range's spill file (Arrow IPC).
    3. Each range in turn is read back, sorted by key, cut to one row per key (the first-written: ``created_at``,
       then input order) and uploaded as one run file named by its key range.

    Returns the new files' store keys. Raises :class:`MissingObject` if an input vanished (another compaction)."""
    run = uuid.uuid4().hex[:8]
    t_ns = min(f.time for f in inputs)
    with tempfile.TemporaryDirectory(prefix="gencache-compact-") as tmp:
        d = Path(tmp)
        paths: list[str] = []
        for i, f in enumerate(inputs):
            local = getattr(cache.store, "local_path", None)
            if local is not None:
                p = local(f.key)
                if not p.exists():
                    raise MissingObject(f"{cache.store.url}/{f.key} does not exist")
                paths.append(str(p))
            else:
                dest = d / f"in-{i:06d}.parquet"
                cache.store.download(f.key, dest)
                paths.append(str(dest))
        metas = [pq.read_metadata(p) for p in paths]
        total_rows = sum(m.num_rows for m in metas)
        total_bytes = sum(m.row_group(g).total_byte_size for m in metas for g in range(m.num_row_groups))
        parts = max(1, math.ceil(total_bytes / run_bytes))
        bounds = _boundaries(paths, parts, total_rows) if parts > 1 else np.array([], dtype=object)
        parts = len(bounds) + 1
        spill = [d / f"part-{j:04d}.arrow" for j in range(parts)]
        schema = CACHE_SCHEMA.append(pa.field("_src", pa.int32()))
        writers: list = [None] * parts
        try:
            for i, p in enumerate(paths):
                for batch in pq.ParquetFile(p).iter_batches(batch_size=ROW_GROUP_ROWS):
                    t = _conform(pa.Table.from_batches([batch]))
                    t = t.append_column("_src", pa.array(np.full(len(t), i, dtype=np.int32)))
                    if parts == 1:
                        groups = [(0, t)]
                    else:
                        b = np.searchsorted(bounds, t["key"].to_numpy(zero_copy_only=False), side="right")
                        order = np.argsort(b, kind="stable")
                        counts = np.bincount(b, minlength=parts)
                        t = t.take(pa.array(order))
                        offsets = np.concatenate([[0], np.cumsum(counts)])
                        groups = [(j, t.slice(int(offsets[j]), int(counts[j]))) for j in range(parts) if counts[j]]
                    for j, part in groups:
                        if writers[j] is None:
                            writers[j] = ipc.new_file(str(spill[j]), schema)
                        writers[j].write_table(part)
        finally:
            for w in writers:
                if w is not None:
                    w.close()
        out = []
        for j in range(parts):
            if writers[j] is None:
                continue
            with pa.memory_map(str(spill[j])) as src:
                t = ipc.open_file(src).read_all()
                order = pc.sort_indices(
                    t.select(["key", "created_at", "_src"]),
                    sort_keys=[("key", "ascending"), ("created_at", "ascending"), ("_src", "ascending")],
                )
                keys = pc.take(t["key"], order).combine_chunks()
                first = pc.not_equal(keys.slice(1), keys.slice(0, len(keys) - 1)).fill_null(True)
                order = pc.filter(order, pa.concat_arrays([pa.array([True]), first]))  # one row per key
                del keys, first
                t = t.drop_columns(["_src"]).take(order)  # the one copy of the range: sorted, deduplicated
            local_out = d / f"out-{j:04d}.parquet"
            _write(t, str(local_out))
            first, last = t["key"][0].as_py(), t["key"][-1].as_py()
            name = _folder(_shared_hex(first, last)) + shard_name(
                "run", first, last, len(t), run=run, part=j, t_ns=t_ns
            )
            del t
            cache.store.upload(cache.prefix + name, local_out)
            local_out.unlink()
            spill[j].unlink()
            out.append(cache.prefix + name)
            pa.default_memory_pool().release_unused()  # the next range reuses the pages, or the system gets them
        return out


def _boundaries(paths: list[str], parts: int, total_rows: int) -> np.ndarray:
    """``parts - 1`` keys cutting the inputs' keys into ranges of about equal rows (from every ``step``-th key)."""
    step = max(1, total_rows // (parts * 256))
    sample = []
    for p in paths:
        for batch in pq.ParquetFile(p).iter_batches(batch_size=ROW_GROUP_ROWS, columns=["key"]):
            sample.extend(batch.column(0).to_numpy(zero_copy_only=False)[::step].tolist())
    sample.sort()
    cuts = sorted({sample[(j * len(sample)) // parts] for j in range(1, parts)})
    return np.array(cuts, dtype=object)


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

    def __init__(
        self,
        store: BlobStore,
        namespace: str,
        spool_dir: str | Path,
        shard_rows: int = 256,
        shard_seconds: float = 15.0,
        max_shards: int = 64,
        max_runs: int = 8,
        run_bytes: int = RUN_BYTES,
    ):
        self.store, self.namespace = store, namespace
        self.prefix = f"{PREFIX}/{namespace}/"
        self.spool_dir = Path(spool_dir) / namespace
        self.shard_rows, self.shard_seconds, self.max_shards = shard_rows, shard_seconds, max_shards
        self.max_runs, self.run_bytes = max_runs, run_bytes
        self.recovered_rows = 0

    # ------------------------------------------------------------------ reading

    def files(self) -> list[CacheFile]:
        """The namespace's Parquet files, oldest first (the order ties between equal ``created_at`` go by)."""
        out = [f for f in (parse_name(k) for k in self.store.list(self.prefix)) if f is not None]
        return sorted(out, key=lambda f: (f.time, f.name))

    def shards(self) -> list[str]:
        """Store keys of every Parquet file of the namespace (sealed shards and compacted runs)."""
        return [f.key for f in self.files()]

    def lookup(self, keys: Iterable[str]) -> dict[str, dict]:
        """Cached rows for the given request keys (missing keys are absent). Reads only the files whose key range
        (in their names) can hold a wanted key, and in those only the row groups whose key statistics can: the
        footer (cached per process: files never change), the key column of those row groups, then the hit rows.
        A key held twice (two writers raced) gives its first-written row (``created_at``, then file order)."""
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        for _ in range(3):
            try:
                return self._lookup(wanted)
            except MissingObject:
                continue  # a compaction replaced a listed file meanwhile: its rows are in the new run
        raise CacheError(
            f"generation cache {self.store.url}/{self.prefix}: files kept vanishing while being read "
            "(a compaction running in a loop?); run again"
        )

    def _files_for(self, wanted: list[str]) -> list[CacheFile]:
        """The files that can hold keys in [``wanted[0]``, ``wanted[-1]``]: those in the folders of the digits the
        two share (one delimited LIST per level), and every file below the deepest (one recursive LIST)."""
        digits = _shared_hex(wanted[0], wanted[-1])
        keys = [k for n in range(len(digits)) for k in self.store.list(self.prefix + _folder(digits[:n]), False)]
        keys += self.store.list(self.prefix + _folder(digits), True)
        out = [f for f in (parse_name(k) for k in keys) if f is not None]
        return sorted(out, key=lambda f: (f.time, f.name))

    def _lookup(self, wanted: list[str]) -> dict[str, dict]:
        best: dict[str, tuple] = {}
        for order, f in enumerate(self._files_for(wanted)):
            cand = f.candidates(wanted)
            if not cand:
                continue
            for row in self._read_hits(f, cand):
                rank = (row.get("created_at") or 0.0, order)
                prev = best.get(row["key"])
                if prev is None or rank < prev[0]:
                    best[row["key"]] = (rank, row)
        return {k: v[1] for k, v in best.items()}

    def _source(self, f: CacheFile):
        """What pyarrow reads ``f`` from: the local path, or a ranged reader over S3 (its footer fetched now)."""
        local = getattr(self.store, "local_path", None)
        if local is not None:
            path = local(f.key)
            if not path.exists():
                raise MissingObject(f"{self.store.url}/{f.key} does not exist")
            return str(path)
        with _FOOTERS_LOCK:
            known = _FOOTERS.get((self.store.url, f.key))
        if known is not None and known[1] is not None:  # footer and size known: no GET until a row group is read
            return _RangedFile(self.store, f.key, known[1], b"")
        tail, size = self.store.read_tail(f.key, FOOTER_BYTES)
        return _RangedFile(self.store, f.key, size, tail)

    def _read_hits(self, f: CacheFile, cand: list[str]) -> Iterator[dict]:
        try:
            src = self._source(f)
            md = _metadata(self.store.url, f.key, src)
            kcol = _key_column(md)
            groups = [g for g in range(md.num_row_groups) if _may_hold(md.row_group(g).column(kcol), cand)]
            if not groups:
                return
            pf = pq.ParquetFile(src, metadata=md)
            value_set = pa.array(cand, pa.string())
            for g in groups:
                if isinstance(src, _RangedFile):
                    src.prefetch(*_span(md.row_group(g), [kcol]))
                keys = pf.read_row_group(g, columns=["key"])["key"]
                hit = pc.is_in(keys, value_set=value_set)
                if not pc.any(hit).as_py():
                    continue  # only the key column was read
                if isinstance(src, _RangedFile):
                    src.prefetch(*_span(md.row_group(g), range(md.num_columns)))
                yield from pf.read_row_group(g).filter(hit).to_pylist()
        except MissingObject:
            raise
        except (OSError, pa.ArrowInvalid) as e:
            raise CacheError(
                f"generation cache file {self.store.url}/{f.key} is unreadable ({e}); delete it to regenerate its rows"
            ) from e

    def __len__(self) -> int:
        """Distinct keys in the namespace (reads every key column: for tests and small caches)."""
        seen: set[str] = set()
        for f in self.files():
            with self._local_copy(f) as path:
                seen.update(pq.read_table(path, columns=["key"])["key"].to_pylist())
        return len(seen)

    @contextmanager
    def _local_copy(self, f: CacheFile) -> Iterator[str]:
        """A local file to read ``f`` from: the store's own file, or a temporary download (streamed)."""
        local = getattr(self.store, "local_path", None)
        if local is not None:
            path = local(f.key)
            if not path.exists():
                raise MissingObject(f"{self.store.url}/{f.key} does not exist")
            yield str(path)
            return
        with tempfile.TemporaryDirectory(prefix="gencache-") as d:
            dest = Path(d) / f.name
            self.store.download(f.key, dest)
            yield str(dest)

    # ------------------------------------------------------------------ recovery, compaction

    def recover(self, on_rows: Callable[[list[dict]], None] | None = None) -> int:
        """Seal spool files left by writers that died; returns the rows recovered. ``on_rows(rows)``: called with
        the rows of each spool once they are sealed into the cache (the Ray stage bills a dead worker's answers
        from them)."""
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
                if rows and on_rows is not None:
                    on_rows(rows)
            finally:
                os.close(fd)
        self.recovered_rows += n
        return n

    def _put_shard(self, rows: list[dict]) -> str:
        """Seal rows as one shard: sorted by key (one row per key: the first-written), named by its key range."""
        first: dict[str, dict] = {}
        for r in rows:
            if r["key"] not in first or (r.get("created_at") or 0.0) < (first[r["key"]].get("created_at") or 0.0):
                first[r["key"]] = r
        ordered = [first[k] for k in sorted(first)]
        first, last = ordered[0]["key"], ordered[-1]["key"]
        key = self.prefix + _folder(_shared_hex(first, last)) + shard_name("shard", first, last, len(ordered))
        self.store.put(key, _table_bytes(ordered))
        return key

    def compact(self) -> int:
        """When more than ``max_shards`` sealed shards have gathered, merge them into one compacted *run* (and,
        once ``max_runs`` runs exist, every file into one run); returns the files merged. See :func:`compact`."""
        files = self.files()
        shards = [f for f in files if f.kind == "shard"]
        runs = {f.run for f in files if f.kind == "run"}
        if len(shards) <= self.max_shards:
            return 0
        inputs = files if len(runs) + 1 > self.max_runs else shards
        try:
            merge_files(self, inputs, self.run_bytes)
        except MissingObject:
            return 0  # another process compacted these files meanwhile; its run holds their rows
        for f in inputs:  # the run is complete before the old files go: a reader never misses a row
            self.store.delete(f.key)
        return len(inputs)

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
            raise CacheError(
                f"{len(errors)} cache shard(s) could not be written to {self.cache.store.url} "
                f"(first: {errors[0]}); their rows are kept in {self.cache.spool_dir} and are "
                f"written by the next run"
            ) from errors[0]

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
