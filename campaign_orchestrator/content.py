"""Content hashes of files, directories and JSON-able values (sha256, hex).

Model fingerprints (:func:`model_fingerprint`) hash every byte of every file: they key the
cross-campaign generation cache, the stage keys and the model-change sensor, so two checkpoints that
differ anywhere must differ here. Each file version is read once (:func:`file_digest`: memoized by
path, size, mtime, ctime and inode, and kept across processes in a :class:`HashCache`)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def dir_sha256(path: str | Path, skip: tuple[str, ...] = ("_SUCCESS", "manifest.json")) -> str:
    """Hash of every file's relative path and content under ``path`` (sorted, deterministic)."""
    root = Path(path)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file() and q.name not in skip):
        h.update(str(p.relative_to(root)).encode())
        h.update(file_sha256(p).encode())
    return h.hexdigest()


def value_sha256(value: Any) -> str:
    """Hash of a JSON-serializable value, independent of dict key order."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def short(digest: str, n: int = 16) -> str:
    return digest[:n]


class UnresolvedKeyWarning(RuntimeWarning):
    """A stage's content key was made from inputs that hold ``auto``: a setting resolved at run time (per device or
    host) that the key does not name, so two runs that compute differently could share the key."""


def unresolved(value: Any, path: str = "") -> list[str]:
    """Where ``value`` (a key's inputs: dicts, lists, scalars) holds the string ``auto``: dotted paths."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in unresolved(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in unresolved(v, f"{path}[{i}]")]
    return [path or "(the value)"] if value == "auto" else []


def stage_key(*parts: Any) -> str:
    """A stage's content key: the hash of its inputs (versions, upstream keys, settings), which hold resolved values,
    never ``auto`` (``campaign_orchestrator/keys.py`` resolves the adapter's); inputs that do are named in an
    :class:`UnresolvedKeyWarning` (the stage still runs: the key is as stable as it always was)."""
    bad = unresolved(list(parts))
    if bad:
        import warnings

        warnings.warn(
            f"a stage key's inputs hold `auto` at {', '.join(bad)} (version {parts[0]!r}): resolve them before keying",
            UnresolvedKeyWarning,
            stacklevel=2,
        )
    return short(value_sha256(list(parts)), 20)


# -------------------------------------------------------------------- file digests, hashed once per version

_MEMO: dict[tuple, str] = {}


def _stat_key(path: Path) -> tuple:
    """What identifies one version of a file without reading it: its path, size, modification and change
    times (ns) and inode. An in-place edit changes the change time even when the modification time is
    put back, and a replaced file has another inode."""
    st = os.stat(path)
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


class HashCache:
    """A persistent table of file digests by :func:`_stat_key` (SQLite: safe across processes), so a
    multi-GB checkpoint is read once per version, not at every code-location load or run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(self.path, timeout=30)
        con.execute(
            "CREATE TABLE IF NOT EXISTS file_sha256 (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
            "ctime_ns INTEGER, ino INTEGER, dev INTEGER, sha256 TEXT NOT NULL)"
        )
        return con

    def get(self, key: tuple) -> str | None:
        try:
            with closing(self._connect()) as con:
                row = con.execute(
                    "SELECT size, mtime_ns, ctime_ns, ino, dev, sha256 FROM file_sha256 WHERE path = ?", (key[0],)
                ).fetchone()
        except sqlite3.Error:
            return None  # an unreadable cache only costs a re-hash
        return row[5] if row is not None and tuple(row[:5]) == key[1:] else None

    def put(self, key: tuple, digest: str) -> None:
        try:
            with closing(self._connect()) as con, con:
                con.execute("INSERT OR REPLACE INTO file_sha256 VALUES (?, ?, ?, ?, ?, ?, ?)", (*key, digest))
        except sqlite3.Error:
            pass


def file_digest(path: str | Path, cache: HashCache | None = None) -> str:
    """sha256 of every byte of ``path``, computed once per version of the file (memoized in the process
    and, with ``cache``, across processes, by path, size, mtime, ctime and inode)."""
    p = Path(path)
    key = _stat_key(p)
    digest = _MEMO.get(key) or (cache.get(key) if cache is not None else None)
    if digest is None:
        digest = file_sha256(p)
        if _stat_key(p) != key:  # written to while it was read: hash what is there now, remember nothing
            return file_digest(p, cache)
        if cache is not None:
            cache.put(key, digest)
    _MEMO[key] = digest
    return digest


def model_fingerprint(path: str | Path, cache: HashCache | None = None) -> str:
    """Identity of a model directory: every file's relative path and the sha256 of all its bytes
    (:func:`file_digest`: each file version is read once; ``cache`` keeps the digests across processes).
    Two checkpoints that differ in any byte have different identities."""
    root = Path(path)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(root)).encode())
        h.update(file_digest(p, cache).encode())
    return h.hexdigest()
