"""JSON Lines read strictly: one object per line, every problem named by file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


def jsonl_objects(text: str, path: str | Path, error: type[Exception]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of ``text`` (the content of ``path``); raises
    ``error("<path>:<line>: ...")`` on a line that is not JSON or not an object."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise error(f"{path}:{n}: expected a JSON object per line, got {type(obj).__name__}")
        yield n, obj
