"""Build the pre-tokenized, packed, sharded Parquet dataset the trainer streams without a tokenizer.

Pipeline (``build_tokenized_dataset``):

1. **Sources** are read with ``datasets`` (``campaign_orchestrator.dataset.sources``: JSONL, JSON, Parquet, CSV, a
   saved dataset directory) and tokenized with its batched, multi-process ``map``
   (``campaign_orchestrator.dataset.formatting.encode_batch``: template, loss mask, EOS, truncation), Arrow batches
   in and out for plain string columns, the garbage collector paused inside each batch.
2. Every row gets a status; drops are counted by reason (``formatting.STATUSES``).
3. A deterministic **train/validation split by example id** (seeded hash of the id, so an
   example stays on its side whatever else changes), then **best-fit-decreasing packing** of each
   split into rows of at most ``max_seq_len`` (``campaign_orchestrator.dataset.packing``).
4. **Sharded Parquet** per split, ``<split>/<split>-00000-of-00003.parquet``, rolled over at
   a size target, with the row schema below and file-level metadata.

Row schema (``ROW_SCHEMA``):
  input_ids, labels, position_ids: list<int32>   labels -100 on tokens without loss;
                                                  position_ids restart at 0 per packed sequence
  num_tokens, num_loss_tokens: int32
  example_ids: list<string>                       the source examples in the row, in order
With teacher top-k log-probabilities in the sources (``teacher.sampling.logprobs``; logit
distillation), also (``TEACHER_ROW_SCHEMA``, ``campaign_orchestrator.dataset.topk``):
  teacher_topk_ids: list<list<int32>>             one list per input token, laid out like input_ids;
  teacher_topk_logprobs: list<list<float32>>      empty where the teacher gave no distribution
and the ``campaign.teacher_topk`` metadata key; without them in the sources these are absent. A teacher with
another tokenizer (``cross_tokenizer``: cross-tokenizer logit distillation, ``campaign_orchestrator.dataset.xtok``)
adds, aligned the same way:
  teacher_align: list<int8>                       0 none, 1 exact, 2 ULD group head, 3 ULD group continuation
  teacher_span_logprob: list<float32>             at a ULD head, the teacher's log-prob of the rest of the group
and ``campaign.teacher_topk`` says ``"alignment": "bytes"`` with the positions of each kind.
``campaign.teacher_tokenizers`` records each teacher's tokenizer identity (a tokenizer hash, or ``api:<model>``
for an endpoint without one) beside ``campaign.tokenizer_hash``, the student's.
File metadata (``campaign.*`` keys, see ``dataset_metadata``): tokenizer hash, template,
max length, packing settings, split, source hash, dataset key and format version. The trainer
refuses a dataset whose tokenizer hash is not its model's, and a directory of mixed datasets.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from campaign_orchestrator.dataset.formatting import DROP_STATUSES, OK, STATUSES, TRUNCATED
from campaign_orchestrator.dataset.tokenizer_files import TokenizationError, tokenizer_hash
from campaign_orchestrator.dataset.topk import (
    SOURCE_COLUMNS,
    SOURCE_TOP_LOGPROBS,
    TEACHER_IDS,
    TEACHER_LOGPROBS,
    TEACHER_STATUSES,
)
from campaign_orchestrator.dataset.xtok import (
    TEACHER_ALIGN,
    TEACHER_SPAN,
    XTOK_SOURCE_COLUMNS,
    XTOK_STATUSES,
    CrossTokenizer,
    alignment_report,
)

FORMAT_VERSION = "2"
SPLITS = ("train", "validation")

ROW_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("position_ids", pa.list_(pa.int32())),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("example_ids", pa.list_(pa.string())),
    ]
)
# With teacher top-k log-probabilities in the sources (logit distillation, ``campaign_orchestrator.dataset.topk``).
TEACHER_FIELDS = [
    pa.field(TEACHER_IDS, pa.list_(pa.list_(pa.int32()))),
    pa.field(TEACHER_LOGPROBS, pa.list_(pa.list_(pa.float32()))),
]
TEACHER_ROW_SCHEMA = pa.schema([*ROW_SCHEMA, *TEACHER_FIELDS])
TEACHER_FIELDS_NAMES = tuple(f.name for f in TEACHER_FIELDS)
# With a teacher of another tokenizer (cross-tokenizer logit distillation, ``campaign_orchestrator.dataset.xtok``).
XTOK_FIELDS = [pa.field(TEACHER_ALIGN, pa.list_(pa.int8())), pa.field(TEACHER_SPAN, pa.list_(pa.float32()))]
XTOK_ROW_SCHEMA = pa.schema([*TEACHER_ROW_SCHEMA, *XTOK_FIELDS])


@dataclass(frozen=True)
class BuildSettings:
    """Everything that changes the rows (all of it is part of the stage's content key)."""

    max_seq_len: int
    template: str = "auto"  # auto | chat | plain
    train_on_prompt: bool = False
    packing: bool = True
    padding: str = "free"  # how the trainer batches the rows: free | longest | max_length
    too_long: str = "drop"  # drop | truncate
    shard_size_bytes: int = 256 << 20
    validation_fraction: float = 0.0
    split_seed: int = 0
    num_proc: int | None = None  # None: every available core (for inputs big enough to pay for it)

    def key_fields(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "num_proc"}

    def resolved(self, tokenizer_dir: str | Path) -> BuildSettings:
        """These settings with ``template: auto`` resolved for the tokenizer in ``tokenizer_dir`` (``chat`` when it
        has a chat template, else ``plain``): what the rows are built with, and what the content key holds (a
        key holds resolved values, never ``auto``; the same rows either way)."""
        if self.template != "auto":
            return self
        from transformers import AutoTokenizer

        from campaign_orchestrator.dataset.formatting import resolve_template

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        return replace(self, template=resolve_template(tok, "auto").kind)


@dataclass
class SplitStats:
    examples: int = 0
    rows: int = 0
    total_tokens: int = 0
    loss_tokens: int = 0
    files: list[str] = field(default_factory=list)
    bytes: int = 0


def split_of(example_id: str, fraction: float, seed: int) -> str:
    """``validation`` for a seeded-hash share ``fraction`` of ids, else ``train``."""
    if fraction <= 0:
        return "train"
    h = hashlib.blake2b(f"{seed}\x00{example_id}".encode(), digest_size=8).digest()
    return "validation" if int.from_bytes(h, "big") / 2**64 < fraction else "train"


def default_num_proc(n_examples: int, requested: int | None = None, per_proc: int = 20_000) -> int:
    """All available cores for big inputs; one process when forking would cost more than it saves."""
    if requested is not None:
        return max(1, requested)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, n_examples // per_proc))


# --------------------------------------------------------------------------- tokenizing


def _encoded_features(teacher: bool = False, xtok: bool = False):
    import datasets

    ints = datasets.List(datasets.Value("int32"))
    features = {
        "id": datasets.Value("string"),
        "input_ids": ints,
        "labels": ints,
        "num_tokens": datasets.Value("int32"),
        "num_loss_tokens": datasets.Value("int32"),
        "status": datasets.Value("string"),
    }
    if teacher:
        floats = datasets.List(datasets.Value("float32"))
        features |= {
            TEACHER_IDS: datasets.List(ints),
            TEACHER_LOGPROBS: datasets.List(floats),
            "teacher_status": datasets.Value("string"),
        }
    if xtok:
        features |= {
            TEACHER_ALIGN: datasets.List(datasets.Value("int8")),
            TEACHER_SPAN: datasets.List(datasets.Value("float32")),
        }
    return datasets.Features(features)


def has_teacher_topk(ds) -> bool:
    """Whether a loaded source carries any teacher top-k lists (a column of nulls does not count)."""
    if SOURCE_TOP_LOGPROBS not in ds.column_names:
        return False
    return ds.data.column(SOURCE_TOP_LOGPROBS).null_count < ds.num_rows


def _encode_batch(batch, **kwargs):
    """``formatting.encode_batch_arrow`` with the cyclic garbage collector paused: a batch allocates
    hundreds of thousands of acyclic objects (encodings, id lists), and every collection they trigger
    would walk the whole heap of the process (its share of the tokenize time: docs/results.md, "Tokenization")."""
    import gc

    from campaign_orchestrator.dataset.formatting import encode_batch_arrow

    enabled = gc.isenabled()
    gc.disable()
    try:
        return encode_batch_arrow(batch, **kwargs)
    finally:
        if enabled:
            gc.enable()


def encode_sources(
    sources,
    tok,
    template,
    settings: BuildSettings,
    work: Path,
    log: Callable[[str], None],
    timings: dict[str, float] | None = None,
    cross_tokenizer: CrossTokenizer | None = None,
) -> pa.Table:
    """Tokenize every source with ``Dataset.map(batched=True, num_proc=...)``; one Arrow table out.

    When any source carries teacher top-k log-probabilities, every example gets the teacher
    columns (``campaign_orchestrator.dataset.topk``; empty lists for examples without them); otherwise they are
    absent. ``cross_tokenizer``: the teacher has another tokenizer; its top-k is placed by byte offsets
    (``campaign_orchestrator.dataset.xtok``, with the alignment columns)."""
    import datasets

    from campaign_orchestrator.dataset.formatting import EncodeSettings
    from campaign_orchestrator.dataset.sources import load_source

    enc = EncodeSettings(settings.max_seq_len, settings.too_long, settings.train_on_prompt)
    t0 = time.perf_counter()
    loaded = [(src, load_source(src, work / "cache")) for src in sources]
    teacher = any(has_teacher_topk(ds) for _src, ds in loaded)
    unused = [*SOURCE_COLUMNS, *XTOK_SOURCE_COLUMNS] if not teacher else [] if cross_tokenizer else XTOK_SOURCE_COLUMNS
    # columns of nulls (a generation without logprobs), or not read on this path: not worth converting
    loaded = [(src, ds.remove_columns([c for c in unused if c in ds.column_names])) for src, ds in loaded]
    if timings is not None:
        timings["read_s"] = timings.get("read_s", 0.0) + time.perf_counter() - t0
    xtok = cross_tokenizer if teacher else None
    features = _encoded_features(teacher, xtok is not None)
    tables = []
    for i, (src, ds) in enumerate(loaded):
        t1 = time.perf_counter()
        nproc = default_num_proc(len(ds), settings.num_proc)
        nproc = min(nproc, max(1, len(ds)))
        log(
            f"tokenizing {len(ds):,} examples of {src.name} with {nproc} process(es)"
            + (" (with the teacher's top-k log-probabilities)" if teacher else "")
            + (", placed by byte offsets (the teacher has another tokenizer)" if xtok is not None else "")
        )
        if len(ds) == 0:
            continue
        # Arrow batches in and out (no conversion of the rows to Python by datasets) where every column is a
        # plain string; other feature types (datasets' Json for mixed JSON values, ...) need its decoding
        plain = all(
            isinstance(f, datasets.Value) and f.dtype in ("string", "large_string") for f in ds.features.values()
        )
        out = (ds.with_format("arrow") if plain else ds).map(
            _encode_batch,
            batched=True,
            batch_size=1000,
            num_proc=nproc if nproc > 1 else None,
            fn_kwargs={"tok": tok, "template": template, "settings": enc, "teacher": xtok or teacher},
            remove_columns=ds.column_names,
            features=features,
            cache_file_name=str(work / f"encoded-{i}.arrow"),
            desc=f"tokenize {src.name}",
        )
        tables.append(out.with_format("arrow")[:])
        if timings is not None:
            timings["tokenize_s"] = timings.get("tokenize_s", 0.0) + time.perf_counter() - t1
    if not tables:
        return features.arrow_schema.empty_table()
    return pa.concat_tables(tables)  # zero-copy over the memory-mapped map() outputs


def _check_ids(table: pa.Table, sources) -> None:
    ids = table.column("id")
    if ids.null_count:
        raise TokenizationError(
            f"{ids.null_count} example(s) have a null `id` in {[s.name for s in sources]}; "
            "every example needs a unique string id (or omit the column to number rows)"
        )
    if pc.count_distinct(ids).as_py() != len(ids):
        vc = pc.value_counts(ids)
        dup = vc.filter(pc.greater(vc.field("counts"), 1))[0]["values"].as_py()
        raise TokenizationError(
            f"example id {dup!r} appears more than once across the sources "
            f"{[s.name for s in sources]}; ids must be unique"
        )


def teacher_report(kept: pa.Table) -> dict | None:
    """What the teacher columns of the kept examples hold: ``k``, positions that carry a teacher
    distribution, and examples per ``teacher_status`` (None without teacher columns). With a teacher of another
    tokenizer also ``alignment`` (``campaign_orchestrator.dataset.xtok``): the label positions per part of the
    loss (``exact``, ``uld``: heads and continuations, ``none``), their shares, and the ULD groups."""
    if TEACHER_IDS not in kept.column_names:
        return None
    per_token = pc.list_flatten(kept.column(TEACHER_IDS))
    lens = pc.list_value_length(per_token)
    xtok = TEACHER_ALIGN in kept.column_names
    examples = {s: 0 for s in (*TEACHER_STATUSES, *(XTOK_STATUSES if xtok else ()))}
    for item in pc.value_counts(kept.column("teacher_status")).to_pylist():
        examples[item["values"]] = item["counts"]
    report = {
        "k": int(pc.max(lens).as_py() or 0) if len(lens) else 0,
        "positions": int(pc.sum(pc.greater(lens, 0)).as_py() or 0) if len(lens) else 0,
        "examples": examples,
    }
    if xtok:
        report["alignment"] = alignment_report(kept.column(TEACHER_ALIGN), kept.column("labels"))
    return report


# --------------------------------------------------------------------------- writing


def write_shards(
    rows: pa.Table,
    out_dir: Path,
    split: str,
    target_bytes: int,
    metadata: dict[str, str],
    row_group_rows: int | None = None,
) -> list[Path]:
    """Write ``rows`` as ``<split>-NNNNN-of-MMMMM.parquet`` files of about ``target_bytes`` each
    (a shard closes after the row group that reaches the target; row groups hold about
    min(8 MiB, target) of uncompressed rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = (
        XTOK_ROW_SCHEMA
        if TEACHER_ALIGN in rows.column_names
        else TEACHER_ROW_SCHEMA
        if TEACHER_IDS in rows.column_names
        else ROW_SCHEMA
    )
    schema = base.with_metadata(metadata)
    rows = rows.select(base.names).cast(base)
    per_row = max(1, rows.nbytes // max(1, rows.num_rows))
    rg_rows = row_group_rows or int(max(1, min(8192, min(8 << 20, target_bytes) // per_row)))
    tmp_files: list[Path] = []
    f = writer = None
    try:
        for start in range(0, max(rows.num_rows, 1), rg_rows):
            if writer is None:
                path = out_dir / f".{split}-{len(tmp_files):05d}.parquet.tmp"
                tmp_files.append(path)
                f = open(path, "wb")  # noqa: SIM115 - closed below or in finally
                writer = pq.ParquetWriter(f, schema, compression="zstd")
            writer.write_table(rows.slice(start, rg_rows), row_group_size=rg_rows)
            if f.tell() >= target_bytes:
                writer.close()
                f.close()
                writer = f = None
    finally:
        if writer is not None:
            writer.close()
        if f is not None:
            f.close()
    n = len(tmp_files)
    final = []
    for i, p in enumerate(tmp_files):
        dest = out_dir / f"{split}-{i:05d}-of-{n:05d}.parquet"
        os.replace(p, dest)
        final.append(dest)
    return final


def dataset_metadata(path: str | Path) -> dict[str, str]:
    """The ``campaign.*`` file metadata of a shard (or of the first shard of a directory)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.rglob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"no Parquet shards under {p}")
        p = files[0]
    md = pq.read_schema(p).metadata or {}
    return {k.decode(): v.decode() for k, v in md.items() if k.startswith(b"campaign.")}


def _topk_metadata(teacher: dict) -> str:
    """``campaign.teacher_topk``: k and the columns (and, by byte offsets, the alignment and its shares)."""
    if "alignment" not in teacher:
        return json.dumps({"k": teacher["k"], "columns": list(TEACHER_FIELDS_NAMES)})
    a = teacher["alignment"]
    return json.dumps(
        {
            "k": teacher["k"],
            "columns": [*TEACHER_FIELDS_NAMES, TEACHER_ALIGN, TEACHER_SPAN],
            "alignment": a["by"],
            "positions": a["positions"],
        },
        sort_keys=True,
    )


def length_histogram(lengths: Sequence[int] | np.ndarray, bins: int = 8, label: str = "tokens") -> str:
    """A markdown table of sequence lengths (for the UI)."""
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.size == 0:
        return ""
    lo, hi = int(arr.min()), int(arr.max())
    width = max(1, -(-(hi - lo + 1) // bins))
    idx = (arr - lo) // width
    counts = np.bincount(idx)
    top = int(counts.max())
    lines = [f"| {label} | count | |", "|---|---:|---|"]
    for b, c in enumerate(counts.tolist()):
        if c:
            lines.append(f"| {lo + b * width}–{lo + (b + 1) * width - 1} | {c} | {'█' * max(1, round(20 * c / top))} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the build


def build_tokenized_dataset(
    tokenizer_dir: str | Path,
    sources: Sequence[str | Path],
    out_dir: str | Path,
    settings: BuildSettings,
    base_dir: str | Path | None = None,
    extra_metadata: dict[str, str] | None = None,
    log: Callable[[str], None] = lambda _m: None,
    cross_tokenizer: CrossTokenizer | None = None,
) -> dict:
    """Tokenize, split, pack and shard ``sources`` into ``out_dir``; returns the report (also
    written as ``out_dir/dataset_info.json``). Raises TokenizationError / SourceError /
    FormatError with the file or field at fault. ``cross_tokenizer``: the teacher's top-k come from another
    tokenizer and are placed by byte offsets (``campaign_orchestrator.dataset.xtok``)."""
    import datasets
    from transformers import AutoTokenizer

    from campaign_orchestrator.dataset.checks import stop_token_report
    from campaign_orchestrator.dataset.formatting import resolve_template
    from campaign_orchestrator.dataset.packing import pack_bfd, pack_rows
    from campaign_orchestrator.dataset.sources import resolve_source, source_hash

    if settings.too_long not in ("drop", "truncate"):
        raise TokenizationError(f"too_long must be 'drop' or 'truncate', got {settings.too_long!r}")
    if settings.padding not in ("free", "longest", "max_length"):
        raise TokenizationError(f"padding must be free, longest or max_length, got {settings.padding!r}")
    if not sources:
        raise TokenizationError("no data sources given: nothing to tokenize")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        shutil.rmtree(out / split, ignore_errors=True)
    work = out / "_work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    resolved = [resolve_source(s, base_dir) for s in sources]
    src_hash = source_hash(resolved)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    template = resolve_template(tok, settings.template)
    progress = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        timings: dict[str, float] = {}
        table = encode_sources(resolved, tok, template, settings, work, log, timings, cross_tokenizer)
        t_split = time.perf_counter()
        examples_in = table.num_rows
        if examples_in == 0:
            raise TokenizationError(
                f"the input is empty: {[str(s) for s in sources]} hold no examples (check the upstream filter counts)"
            )
        _check_ids(table, resolved)
        status = table.column("status")
        counts = {s: 0 for s in STATUSES}
        for item in pc.value_counts(status).to_pylist():
            counts[item["values"]] = item["counts"]
        kept = table.filter(pc.is_in(status, pa.array([OK, TRUNCATED])))
        if kept.num_rows == 0:
            reasons = {k: v for k, v in counts.items() if v}
            raise TokenizationError(
                f"every one of the {examples_in} examples was dropped ({reasons}); "
                + (
                    "raise training.max_seq_len or set dataset.too_long: truncate"
                    if counts["too_long"]
                    else "check the source columns and types"
                )
            )
        teacher = teacher_report(kept)
        stop = stop_token_report(kept, [template.eos_id])
        if settings.validation_fraction > 0:
            ids = kept.column("id").to_pylist()
            is_val = np.fromiter(
                (split_of(i, settings.validation_fraction, settings.split_seed) == "validation" for i in ids),
                dtype=bool,
                count=len(ids),
            )
        else:
            is_val = np.zeros(kept.num_rows, dtype=bool)
        metadata = {
            "campaign.format_version": FORMAT_VERSION,
            "campaign.tokenizer_hash": tokenizer_hash(tokenizer_dir),
            "campaign.template": template.describe(),
            "campaign.chat_template_sha256": hashlib.sha256((template.chat_template or "").encode()).hexdigest(),
            "campaign.max_seq_len": str(settings.max_seq_len),
            "campaign.packing": json.dumps(
                {
                    "packing": "bfd" if settings.packing else "none",
                    "padding": settings.padding,
                    "too_long": settings.too_long,
                    "train_on_prompt": settings.train_on_prompt,
                },
                sort_keys=True,
            ),
            "campaign.padding": settings.padding,
            "campaign.split": json.dumps(
                {"by": "example_id", "validation_fraction": settings.validation_fraction, "seed": settings.split_seed},
                sort_keys=True,
            ),
            "campaign.source_hash": src_hash,
            **({"campaign.teacher_topk": _topk_metadata(teacher)} if teacher else {}),
            **(
                {"campaign.teacher_tokenizers": json.dumps(cross_tokenizer.identities, sort_keys=True)}
                if cross_tokenizer is not None
                else {}
            ),
            **(extra_metadata or {}),
        }
        splits: dict[str, SplitStats] = {}
        timings["split_s"] = time.perf_counter() - t_split
        timings["pack_s"] = timings["write_s"] = 0.0
        row_fill: list[np.ndarray] = []
        for split, mask in (("train", ~is_val), ("validation", is_val)):
            part = kept if mask.all() else kept.filter(pa.array(mask))
            st = SplitStats(examples=part.num_rows)
            splits[split] = st
            if part.num_rows == 0:
                continue
            lengths = part.column("num_tokens").to_numpy()
            t0 = time.perf_counter()
            bins = pack_bfd(lengths, settings.max_seq_len) if settings.packing else [[i] for i in range(part.num_rows)]
            rows = pack_rows(part, bins)
            t1 = time.perf_counter()
            files = write_shards(
                rows, out / split, split, settings.shard_size_bytes, metadata | {"campaign.split_name": split}
            )
            timings["pack_s"] += t1 - t0
            timings["write_s"] += time.perf_counter() - t1
            st.rows = rows.num_rows
            st.total_tokens = int(pc.sum(rows.column("num_tokens")).as_py())
            st.loss_tokens = int(pc.sum(rows.column("num_loss_tokens")).as_py())
            st.files = [str(p.relative_to(out)) for p in files]
            st.bytes = sum(p.stat().st_size for p in files)
            if split == "train":
                row_fill.append(rows.column("num_tokens").to_numpy())
        if splits["train"].rows == 0:
            raise TokenizationError(
                f"the train split is empty: all {kept.num_rows} kept examples fell in validation "
                f"(validation_fraction={settings.validation_fraction}); lower it"
            )
        lengths_all = kept.column("num_tokens").to_numpy()
        total = sum(s.total_tokens for s in splits.values())
        rows_n = sum(s.rows for s in splits.values())
        report = {
            "format_version": FORMAT_VERSION,
            "sources": [str(s) for s in sources],
            "source_hash": src_hash,
            "template": template.kind,
            "examples_in": examples_in,
            "examples_out": kept.num_rows,
            "dropped": {s: counts[s] for s in DROP_STATUSES},
            "dropped_total": sum(counts[s] for s in DROP_STATUSES),
            "truncated": counts[TRUNCATED],
            "rows": rows_n,
            "total_tokens": total,
            "loss_tokens": sum(s.loss_tokens for s in splits.values()),
            "packing_efficiency": total / (rows_n * settings.max_seq_len),
            "unpacked_padded_efficiency": total / (kept.num_rows * settings.max_seq_len),
            "shards": sum(len(s.files) for s in splits.values()),
            "bytes": sum(s.bytes for s in splits.values()),
            "splits": {k: asdict(v) for k, v in splits.items()},
            "settings": settings.key_fields(),
            "timings": {k: round(v, 3) for k, v in timings.items()},
            "metadata": metadata,
            "length_histogram": length_histogram(lengths_all, label="example tokens"),
            "row_fill_histogram": length_histogram(np.concatenate(row_fill), label="row tokens") if row_fill else "",
            "teacher_topk": teacher,
            "stop_token": stop,
        }
        (out / "dataset_info.json").write_text(json.dumps(report, indent=2, sort_keys=True))
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if progress:
            datasets.enable_progress_bars()
