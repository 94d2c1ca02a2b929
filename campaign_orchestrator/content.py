"""Content hashes of files, directories and JSON-able values (sha256, hex)."""

from __future__ import annotations

import hashlib
import json
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


def model_fingerprint(path: str | Path, full_hash_limit: int = 64 << 20) -> str:
    """Identity of a model directory: full content hash of small files; for large weight
    files, their size plus the hash of their first and last MiB (cheap on multi-GB shards)."""
    root = Path(path)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(str(p.relative_to(root)).encode())
        size = p.stat().st_size
        if size <= full_hash_limit:
            h.update(file_sha256(p).encode())
        else:
            with open(p, "rb") as f:
                head = f.read(_CHUNK)
                f.seek(size - _CHUNK)
                h.update(f"{size}".encode() + hashlib.sha256(head + f.read(_CHUNK)).digest())
    return h.hexdigest()
