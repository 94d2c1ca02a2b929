"""What the promoted folder (``<artifact root>/<campaign>/promoted_model/<key>/``) records, with no absolute path in
it: the folder is what a team copies, uploads to a hub or hands on, so a path on the build machine means nothing
there and says where someone's home directory is.

* In the project's records (``promotion.json``, the adapter's ``adapter_config.json`` and ``reproducibility.json``;
  the model card is rendered from portable values), a path under the artifact root is written relative to it
  (``models/gguf/<hash>``, ``<campaign>/tokenized_dataset/<key>``); one under the campaign's project directory
  relative to that (``campaigns/data/demo/*.jsonl``, as a campaign file writes it); any other by its last name.
* ``adapter/adapter_config.json``'s ``base_model_name_or_path`` names the base as the world knows it: its hub id
  where one is known (the packaged SmolLM2: ``HuggingFaceTB/SmolLM2-135M-Instruct``), else the campaign's model
  reference (``@demo/student``). PEFT reads it only to load a base for you; the documented way,
  ``PeftModel.from_pretrained(base, adapter_dir)`` with the base loaded from its own folder, ignores it.
* ``promotion.json`` keeps the base's folder relative to the artifact root, which drift scoring resolves against
  the root the promoted folder lives in (:meth:`evaluation.drift.Promoted.base_model_path`).

No torch, no Dagster: plain files."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
# an absolute POSIX path inside a string: a slash that starts a word (not a URL's `//`, not `tokens/s`)
ABSOLUTE = re.compile(r"(?<![\w:/.~-])/(?:[\w.@*+=,-]+/)*[\w.@*+=,-]+")


def portable(value: str, roots: Iterable[str | Path]) -> str:
    """``value`` with every absolute path in it made portable: relative to the deepest of ``roots`` that holds it
    (``.`` for a root itself), else its last name."""
    ordered = sorted({str(Path(r)) for r in roots if r}, key=len, reverse=True)

    def one(m: re.Match) -> str:
        p = m.group(0)
        for r in ordered:
            if p == r:
                return "."
            if p.startswith(r.rstrip("/") + "/"):
                return p[len(r.rstrip("/")) + 1 :]
        return Path(p).name or p

    return ABSOLUTE.sub(one, value)


def portable_json(value, roots: Iterable[str | Path]):
    """A JSON value with :func:`portable` applied to every string in it (keys included)."""
    roots = list(roots)
    if isinstance(value, str):
        return portable(value, roots)
    if isinstance(value, list):
        return [portable_json(v, roots) for v in value]
    if isinstance(value, dict):
        return {portable(k, roots): portable_json(v, roots) for k, v in value.items()}
    return value


# The project's own records in the promoted folder; the rest (weights, the base's tokenizer and serving files, the
# item rows) is copied as it is: a tokenizer's vocabulary may hold tokens that look like paths (`/api`).
RECORDS = ("promotion.json", "adapter/" + ADAPTER_CONFIG, "adapter/reproducibility.json")


def make_portable(folder: str | Path, roots: Iterable[str | Path], base_model_name: str) -> list[Path]:
    """Rewrite the project's records in ``folder`` (:data:`RECORDS`) without absolute paths, and point the adapter's
    ``base_model_name_or_path`` at ``base_model_name`` (a hub id or the campaign's reference); returns the files
    changed."""
    roots = list(roots)
    changed = []
    for f in (Path(folder) / r for r in RECORDS):
        if not f.is_file():
            continue
        doc = json.loads(f.read_text())
        new = portable_json(doc, roots)
        if f.name == ADAPTER_CONFIG and isinstance(new, dict):
            new["base_model_name_or_path"] = base_model_name
        if new != doc:
            f.write_text(json.dumps(new, indent=2) + "\n")
            changed.append(f)
    return changed


def base_model_record(ref: str, path: str | Path, artifact_root: str | Path, project_dir) -> dict:
    """``promotion.json``'s account of the base (the campaign's reference ``ref``, resolved to the folder ``path``):
    the reference, its hub id where known (a converted model's card may name it), and its folder relative to the
    artifact root (where drift scoring looks for it)."""
    from campaign_orchestrator import models

    roots = [artifact_root, project_dir]
    return {
        "base_model": portable(ref, roots),
        "base_model_hub_id": models.hub_id(ref, project_dir, models.read_model_card(path)),
        "base_model_path": portable(str(path), [artifact_root]),
        "paths_relative_to": "the artifact root (base_model_path); the campaign's project directory (data)",
    }
