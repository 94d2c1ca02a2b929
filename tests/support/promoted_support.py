"""Checks of a promoted folder (``<artifact root>/<campaign>/promoted_model/<key>/``): no absolute path in any file,
a model card the hub's library loads."""

from __future__ import annotations

import os
import re
from pathlib import Path

# an absolute POSIX path in text: a slash starting a word, two or more parts (not `tokens/s`, not a URL's `//`)
ABSOLUTE = re.compile(r"(?<![\w:/.~-])/(?:[\w.@+-]+/)+[\w.@+-]+")


# the base's tokenizer and serving files, copied as they are (a vocabulary may hold tokens that look like paths)
BASE_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "generation_config.json",
}


def absolute_paths_in(folder: Path, roots: list[Path]) -> list[str]:
    """``file: what`` for every absolute path found in the files under ``folder``: any of ``roots`` (and their
    resolved forms, and the home directory) anywhere in a file's bytes, binary files included; and in the project's
    text files (JSON, Markdown, text, YAML; not the base's tokenizer files) any absolute path at all."""
    needles = {str(r) for r in roots} | {str(Path(r).resolve()) for r in roots} | {os.path.expanduser("~")}
    needles = {n.encode() for n in needles if len(n) > 1}
    found = []
    for f in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        data = f.read_bytes()
        found += [f"{f.relative_to(folder)}: {n.decode()}" for n in sorted(needles) if n in data]
        if f.suffix in (".json", ".md", ".txt", ".yaml") and f.name not in BASE_FILES:
            found += [f"{f.relative_to(folder)}: {m}" for m in ABSOLUTE.findall(data.decode(errors="replace"))]
    return found
