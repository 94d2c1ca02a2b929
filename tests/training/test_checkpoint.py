"""Checkpoint storage: atomic writes, choice of the newest complete one, retention, S3 mirror (moto)."""

from __future__ import annotations

import pytest

from training.checkpoint import MARKER, CheckpointStore


def _write(store: CheckpointStore, step: int, payload: bytes = b"w") -> None:
    tmp = store.begin(step)
    (tmp / "adapter_model.safetensors").write_bytes(payload)
    (tmp / "trainer_state.json").write_text(f'{{"step": {step}}}')
    store.commit(tmp, step)


def test_interrupted_writes_are_never_chosen(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep_last=3)
    assert store.latest() is None
    _write(store, 10)
    # a crash while writing step 20: the temporary directory is left behind
    tmp = store.begin(20)
    (tmp / "adapter_model.safetensors").write_bytes(b"half")
    # a crash between the rename and the marker: step 30 is in place but unmarked
    tmp30 = store.begin(30)
    (tmp30 / "adapter_model.safetensors").write_bytes(b"x")
    tmp30.rename(store.path(30))
    assert store.local_steps() == [10]
    assert store.latest() == 10
    # a later successful save of step 30 replaces the unmarked leftover
    _write(store, 30, b"good")
    assert store.latest() == 30 and (store.path(30) / "adapter_model.safetensors").read_bytes() == b"good"


def test_a_crash_inside_save_leaves_the_previous_checkpoint_chosen(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "ck")
    _write(store, 5)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("training.checkpoint.os.replace", boom)
    with pytest.raises(OSError):
        _write(store, 6)
    monkeypatch.undo()
    assert store.latest() == 5 and not store.is_complete(6)


def test_retention_keeps_the_newest_complete_and_drops_stale_leftovers(tmp_path):
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    for s in (1, 2, 3, 4):
        _write(store, s)
    stale = store.local / ".step-00000002.tmp-999999"
    stale.mkdir()
    (store.local / "step-00000003x").mkdir()  # not ours: left alone
    unmarked = store.path(2)
    (unmarked / MARKER).unlink()
    assert store.prune() == [1]
    assert store.local_steps() == [3, 4]
    assert not stale.exists() and not unmarked.exists()
    assert (store.local / "step-00000003x").exists()


def test_s3_mirror_upload_fetch_and_retention(tmp_path, s3):
    uri = "s3://ckpts/runs/demo/abc"
    store = CheckpointStore(tmp_path / "a", remote_uri=uri, keep_last=2)
    assert (store.bucket, store.prefix) == ("ckpts", "runs/demo/abc")
    for step in (2, 4):
        _write(store, step, f"w{step}".encode())
        store.upload(step)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpts")["Contents"]]
    assert "runs/demo/abc/step-00000004/_SUCCESS" in keys
    assert store.remote_steps() == [2, 4]
    # an upload that died before its marker is not a checkpoint
    s3.put_object(Bucket="ckpts", Key="runs/demo/abc/step-00000006/adapter_model.safetensors", Body=b"half")
    assert store.remote_steps() == [2, 4]
    # a fresh machine (empty local disk) finds and fetches the newest complete remote checkpoint
    fresh = CheckpointStore(tmp_path / "b", remote_uri=uri, keep_last=2)
    assert fresh.local_steps() == [] and fresh.latest() == 4
    path = fresh.fetch(4)
    assert (path / "adapter_model.safetensors").read_bytes() == b"w4" and (path / MARKER).exists()
    # retention removes older remote checkpoints, marker first
    _write(store, 8, b"w8")
    store.upload(8)
    store.prune()
    assert store.remote_steps() == [4, 8]
    left = {o["Key"].split("/")[3] for o in s3.list_objects_v2(Bucket="ckpts")["Contents"]}
    assert "step-00000002" not in left


def test_refuses_to_upload_an_incomplete_checkpoint(tmp_path, s3):
    store = CheckpointStore(tmp_path / "a", remote_uri="s3://ckpts/x")
    tmp = store.begin(3)
    tmp.rename(store.path(3))
    with pytest.raises(RuntimeError, match="incomplete"):
        store.upload(3)
