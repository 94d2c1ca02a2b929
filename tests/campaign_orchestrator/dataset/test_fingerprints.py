"""Identities that are true: a model's fingerprint covers every byte of every file (one byte changed
in the middle of a 100 MiB shard, size and mtime unchanged, is a new identity), and each file version
is read once: later calls, in this process or another, take the digest from the cache."""

from __future__ import annotations

import os

from campaign_orchestrator import content
from campaign_orchestrator.content import HashCache, model_fingerprint

MIB = 1 << 20


def test_one_byte_in_the_middle_of_a_large_shard_changes_the_identity(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    shard = model / "model-00001-of-00001.safetensors"
    with open(shard, "wb") as f:
        for i in range(100):
            f.write(bytes([i]) * MIB)
    cache = HashCache(tmp_path / "hashes.sqlite")
    reads = []
    real = content.file_sha256
    monkeypatch.setattr(content, "file_sha256", lambda p: reads.append(os.path.basename(p)) or real(p))

    before = model_fingerprint(model, cache)
    assert sorted(reads) == ["config.json", shard.name]
    assert model_fingerprint(model, cache) == before and len(reads) == 2  # memoized: nothing read again
    content._MEMO.clear()  # as a new process would start
    assert model_fingerprint(model, cache) == before and len(reads) == 2  # the persistent cache answers

    st = os.stat(shard)
    with open(shard, "r+b") as f:  # one byte, 50 MiB in; same size, and the modification time put back
        f.seek(50 * MIB)
        f.write(b"\xff")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(shard).st_size == st.st_size and os.stat(shard).st_mtime_ns == st.st_mtime_ns
    after = model_fingerprint(model, cache)
    assert after != before and reads.count(shard.name) == 2  # the changed file (only) was read again
