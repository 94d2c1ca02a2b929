"""Where training checkpoints live: atomic local directories, optionally mirrored to S3.

Layout (local ``<output_dir>/checkpoints`` and, when mirrored, ``s3://bucket/prefix``)::

    step-00000050/
        adapter_config.json, adapter_model.safetensors   the LoRA weights, a loadable PEFT adapter
        optimizer.pt        AdamW state per parameter name (full tensors, any world size can load it)
        rng.pt              per-rank RNG states
        trainer_state.json  step, data position, LR schedule, plan, eval loss before training
        metrics.parquet     the per-step metrics so far
        _SUCCESS            written last: a directory without it is never chosen

A checkpoint is written under a temporary name (``.step-….tmp-<pid>``), renamed into place,
then marked complete; remotely, every file is uploaded before the marker, and deletion removes
the marker first. Only complete checkpoints are ever chosen for resume.

:class:`CheckpointStore` does storage only. :func:`save_training_state` and
:func:`load_training_state` are the trainer's checkpoint state: collectives that gather the full
LoRA and optimizer tensors on global rank 0 (any world size can resume them), per-rank RNG
streams, and the trainer state, around the store. torch is imported inside them, so the store
alone stays importable without it. Credentials and the endpoint for S3 come from the standard
AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL_S3``, …), never from the spec.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

from campaigns.object_store import parse_s3_url, s3_client
from training.errors import TrainingError

MARKER = "_SUCCESS"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


class CheckpointStore:
    def __init__(self, local_dir: str | Path, remote_uri: str | None = None, keep_last: int = 2, s3_client=None):
        self.local = Path(local_dir)
        self.remote_uri = remote_uri
        self.keep_last = keep_last
        self._s3 = s3_client
        if remote_uri:
            self.bucket, self.prefix = parse_s3_url(remote_uri, "checkpoint mirror (checkpoint_uri)")

    # ------------------------------------------------------------------ local
    def path(self, step: int) -> Path:
        return self.local / step_name(step)

    def is_complete(self, step: int) -> bool:
        return (self.path(step) / MARKER).exists()

    def local_steps(self) -> list[int]:
        """Steps of complete local checkpoints, ascending."""
        if not self.local.is_dir():
            return []
        out = []
        for d in self.local.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and d.is_dir() and (d / MARKER).exists():
                out.append(int(m.group(1)))
        return sorted(out)

    def begin(self, step: int) -> Path:
        """A fresh temporary directory to write checkpoint ``step`` into."""
        self.local.mkdir(parents=True, exist_ok=True)
        tmp = self.local / f".{step_name(step)}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int) -> Path:
        """Rename ``tmp`` into place, then write the completion marker (fsync'd)."""
        final = self.path(step)
        if final.exists():  # an incomplete leftover of an interrupted earlier attempt
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final)
        with open(final / MARKER, "w") as f:
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(self.local)
        return final

    # ------------------------------------------------------------------ remote
    @property
    def s3(self):
        if self._s3 is None:
            self._s3 = s3_client(max_attempts=8)
        return self._s3

    def _key(self, step: int, name: str) -> str:
        return "/".join(p for p in (self.prefix, step_name(step), name) if p)

    def remote_steps(self) -> list[int]:
        """Steps of complete remote checkpoints (marker present), ascending."""
        if not self.remote_uri:
            return []
        base = f"{self.prefix}/" if self.prefix else ""
        steps = set()
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                parts = obj["Key"][len(base) :].split("/")
                if len(parts) == 2 and parts[1] == MARKER and (m := _STEP_DIR.match(parts[0])):
                    steps.add(int(m.group(1)))
        return sorted(steps)

    def upload(self, step: int) -> None:
        """Upload a complete local checkpoint; the marker goes last."""
        src = self.path(step)
        if not (src / MARKER).exists():
            raise RuntimeError(f"refusing to upload incomplete checkpoint {src}")
        for f in sorted(src.iterdir()):
            if f.name != MARKER and f.is_file():
                self.s3.upload_file(str(f), self.bucket, self._key(step, f.name))
        self.s3.put_object(Bucket=self.bucket, Key=self._key(step, MARKER), Body=b"")

    def fetch(self, step: int) -> Path:
        """Make checkpoint ``step`` complete locally, downloading it when only the remote copy exists."""
        if self.is_complete(step):
            return self.path(step)
        tmp = self.begin(step)
        base = self._key(step, "") + "/"
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(base) :]
                if name and name != MARKER and "/" not in name:
                    self.s3.download_file(self.bucket, obj["Key"], str(tmp / name))
        return self.commit(tmp, step)

    def _delete_remote(self, step: int) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(step, MARKER))  # incomplete from here on
        base = self._key(step, "") + "/"
        keys = [
            o["Key"]
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
            for o in page.get("Contents", [])
        ]
        for i in range(0, len(keys), 1000):
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})

    # ------------------------------------------------------------------ choice and retention
    def latest(self) -> int | None:
        """The newest complete checkpoint, local or remote."""
        steps = set(self.local_steps()) | set(self.remote_steps())
        return max(steps) if steps else None

    def prune(self) -> list[int]:
        """Keep the newest ``keep_last`` complete checkpoints; drop older ones and stale temporaries."""
        removed = []
        local = self.local_steps()
        for step in local[: -self.keep_last]:
            (self.path(step) / MARKER).unlink(missing_ok=True)  # incomplete first, then gone
            shutil.rmtree(self.path(step), ignore_errors=True)
            removed.append(step)
        newest = local[-1] if local else None
        if self.local.is_dir() and newest is not None:
            for d in self.local.iterdir():
                m = _STEP_DIR.match(d.name)
                stale_tmp = d.name.startswith(".step-") and ".tmp-" in d.name and not d.name.endswith(f"-{os.getpid()}")
                stale_incomplete = m is not None and not (d / MARKER).exists() and int(m.group(1)) < newest
                if stale_tmp or stale_incomplete:
                    shutil.rmtree(d, ignore_errors=True)
        if self.remote_uri:
            remote = self.remote_steps()
            for step in remote[: -self.keep_last]:
                self._delete_remote(step)
                removed.append(step)
        return sorted(set(removed))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the trainer's state


def peft_key(param_name: str, adapter: str = "default") -> str:
    """The key PEFT writes for a LoRA parameter (the adapter name removed, as ``get_peft_model_state_dict`` does;
    a ``modules_to_save`` copy, e.g. a trained MoE router, under the original module's name)."""
    return param_name.replace(f".modules_to_save.{adapter}.", f".{adapter}.").replace(f".{adapter}", "")


def rng_state() -> dict:
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_metrics(metrics: list[dict], path: Path) -> None:
    """The per-step metrics as Parquet (an empty table with a ``step`` column when there are none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(metrics) if metrics else pa.table({"step": pa.array([], pa.int64())}), path)


def gather_adapter(named_trainable, is_main: bool) -> dict:
    """LoRA weights as full tensors on global rank 0 (collective; empty elsewhere)."""
    from training.sharded import full_tensor

    out = {}
    for name, p in named_trainable:
        t = full_tensor(p.detach())
        if is_main:
            out[name] = t.cpu().clone()
    return out


def gather_optimizer(optimizer, named_trainable, is_main: bool) -> dict:
    """The optimizer state as full tensors by parameter name on global rank 0 (collective)."""
    import torch

    from training.sharded import full_tensor

    state: dict[str, dict] = {}
    for name, p in named_trainable:
        st = optimizer.state.get(p, {})
        if not st:
            continue
        entry = {k: (full_tensor(v).cpu().clone() if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in st.items()}
        if is_main:
            state[name] = entry
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def write_peft_adapter(peft_config, weights: dict, directory: Path) -> None:
    """Write ``weights`` (full LoRA tensors by parameter name) as a PEFT adapter directory (rank 0)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    peft_config.save_pretrained(str(directory))
    save_file(
        {peft_key(k): v.contiguous() for k, v in weights.items()},
        str(directory / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )


def save_training_state(
    store: CheckpointStore,
    step: int,
    peft_config,
    named_trainable,
    optimizer,
    trainer_state: dict,
    metrics: list[dict],
    is_main: bool,
    world: int,
) -> Path:
    """Collective: gather full adapter and optimizer state on rank 0, write atomically, mirror, prune."""
    import torch
    import torch.distributed as dist

    weights = gather_adapter(named_trainable, is_main)
    optim = gather_optimizer(optimizer, named_trainable, is_main)
    rng: list = [None] * world
    dist.all_gather_object(rng, rng_state())
    if is_main:
        tmp = store.begin(step)
        write_peft_adapter(peft_config, weights, tmp)
        torch.save(optim, tmp / "optimizer.pt")
        torch.save(rng, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        write_metrics(metrics, tmp / "metrics.parquet")
        store.commit(tmp, step)
    dist.barrier()  # every rank's part is in; rank 0 wrote it
    if is_main:
        if store.remote_uri:
            store.upload(step)
        store.prune()
    return store.path(step)


def load_training_state(
    store: CheckpointStore,
    named_trainable,
    optimizer,
    scheduler,
    is_main: bool,
    rank: int,
    world: int,
    expect: dict[str, Any],
) -> tuple[int, dict, list[dict]] | None:
    """Collective: restore the newest complete checkpoint into the trainable parameters, optimizer,
    scheduler and RNG; ``(step, trainer state, metrics so far)`` (metrics on rank 0 only), or None.

    ``expect`` holds the settings a resume must share with the run that wrote it (rows per step,
    dataset rows, seed): a mismatch is a :class:`TrainingError` that says how to recover."""
    import torch
    import torch.distributed as dist

    from training.sharded import load_full_into

    box: list = [None]
    if is_main:
        step = store.latest()
        if step is not None:
            store.fetch(step)  # downloads it when only the remote copy exists
        box = [step]
    dist.broadcast_object_list(box, src=0)
    dist.barrier()  # rank 0 has it locally before anyone reads
    step = box[0]
    if step is None:
        return None
    path = store.path(step)
    state_box: list = [json.loads((path / "trainer_state.json").read_text()) if is_main else None]
    dist.broadcast_object_list(state_box, src=0)
    state = state_box[0]
    if tuple(state[k] for k in expect) != tuple(expect.values()):
        raise TrainingError(
            f"checkpoint {path} was written with {state['rows_per_step']} rows per step, {state['dataset_rows']} "
            f"dataset rows and seed {state['seed']}; this run has {expect['rows_per_step']}, {expect['dataset_rows']} "
            f"and {expect['seed']}. Restore those settings or delete {store.local} to start over"
        )
    weights = optim = rng = None
    if is_main:
        from safetensors.torch import load_file

        weights = load_file(str(path / "adapter_model.safetensors"))
        optim = torch.load(path / "optimizer.pt", weights_only=False)
        rng = torch.load(path / "rng.pt", weights_only=False)
    for name, p in named_trainable:
        full = weights[peft_key(name)] if is_main else torch.empty(p.shape, dtype=p.dtype)
        load_full_into(p, full)
    scatter_optimizer(optimizer, named_trainable, optim, is_main)
    scheduler.load_state_dict(state["scheduler"])
    mine: list = [None]
    if state["world_size"] == world:  # per-rank RNG streams continue; otherwise reseed per rank and step
        dist.scatter_object_list(mine, rng if is_main else None, src=0)
    if mine[0] is not None:
        set_rng_state(mine[0])
    else:
        torch.manual_seed(state["seed"] + 1 + rank + 1_000_003 * step)
    metrics: list[dict] = []
    if is_main:
        import pyarrow.parquet as pq

        mp = path / "metrics.parquet"
        metrics = pq.read_table(mp).to_pylist() if mp.exists() else []
    return step, state, metrics


def scatter_optimizer(optimizer, named_trainable, optim: dict | None, is_main: bool) -> None:
    """Collective: load rank 0's full optimizer state (``optim``) into each rank's shards."""
    import torch
    import torch.distributed as dist

    from training.sharded import load_full_into

    box: list = [(sorted(optim["state"]), optim["param_groups"]) if is_main else None]
    dist.broadcast_object_list(box, src=0)
    names, groups = set(box[0][0]), box[0][1]
    if len(groups) != len(optimizer.param_groups):
        raise TrainingError(
            f"checkpoint has {len(groups)} optimizer parameter groups, this run has {len(optimizer.param_groups)}"
        )
    for group, saved in zip(optimizer.param_groups, groups, strict=False):
        group.update(saved)  # the current lr (the scheduler's state does not carry it), betas, decay
    for name, p in named_trainable:
        if name not in names:
            continue
        src = optim["state"][name] if is_main else None
        meta: list = [
            {k: (v if not (torch.is_tensor(v) and v.dim() > 0) else None) for k, v in src.items()} if is_main else None
        ]
        dist.broadcast_object_list(meta, src=0)
        entry = {}
        for k, v in meta[0].items():
            if v is not None:
                entry[k] = v.clone() if torch.is_tensor(v) else v
                continue
            dest = torch.zeros_like(p.detach())
            load_full_into(dest, src[k] if is_main else torch.empty(p.shape, dtype=p.dtype))
            entry[k] = dest
        optimizer.state[p] = entry
