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

This module does storage only; the trainer does the collectives (gathering full tensors on
global rank 0, barriers) around it. Credentials and the endpoint for S3 come from the standard
AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL_S3``, …), never from the spec.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

MARKER = "_SUCCESS"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_s3_uri(uri: str) -> tuple[str, str]:
    m = re.match(r"^s3://([^/]+)/?(.*)$", uri)
    if not m:
        raise ValueError(f"expected an s3://bucket/prefix URI, got {uri!r}")
    return m.group(1), m.group(2).strip("/")


class CheckpointStore:
    def __init__(self, local_dir: str | Path, remote_uri: str | None = None, keep_last: int = 2, s3_client=None):
        self.local = Path(local_dir)
        self.remote_uri = remote_uri
        self.keep_last = keep_last
        self._s3 = s3_client
        if remote_uri:
            self.bucket, self.prefix = parse_s3_uri(remote_uri)

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
            import boto3
            from botocore.config import Config

            self._s3 = boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 8}))
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
                parts = obj["Key"][len(base):].split("/")
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
                name = obj["Key"][len(base):]
                if name and name != MARKER and "/" not in name:
                    self.s3.download_file(self.bucket, obj["Key"], str(tmp / name))
        return self.commit(tmp, step)

    def _delete_remote(self, step: int) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(step, MARKER))  # incomplete from here on
        base = self._key(step, "") + "/"
        keys = [o["Key"] for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base)
                for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})

    # ------------------------------------------------------------------ choice and retention
    def latest(self) -> int | None:
        """The newest complete checkpoint, local or remote."""
        steps = set(self.local_steps()) | set(self.remote_steps())
        return max(steps) if steps else None

    def prune(self) -> list[int]:
        """Keep the newest ``keep_last`` complete checkpoints; drop older ones and stale temporaries."""
        removed = []
        local = self.local_steps()
        for step in local[:-self.keep_last]:
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
            for step in remote[:-self.keep_last]:
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
