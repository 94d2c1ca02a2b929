"""The content-addressed generation cache: keys, shards, spool recovery, compaction, S3 (moto)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal

import pytest

from campaign_orchestrator.generation.blobstore import LocalStore, S3Store, open_store
from campaign_orchestrator.generation.cache import GenerationCache
from campaign_orchestrator.generation.requests import Sampling, build_requests, request_key


def _row(key: str, text: str = "x") -> dict:
    return {
        "key": key,
        "input": "p",
        "sample_index": 0,
        "completion": text,
        "finish_reason": "stop",
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "latency_s": 0.1,
        "retries": 0,
        "top_logprobs": [[(5, None, -0.5), (6, None, -2.5)], [(2, None, -0.25), (7, None, -4.0)]],
        "completion_token_ids": [5, 2],
        "backend": "t",
        "model": "m",
        "teacher_identity": "id",
        "created_at": 0.0,
    }


def test_request_keys_are_content_addressed():
    s = Sampling(max_new_tokens=16)
    k = request_key("teacher@rev1", s, "encode abc =", 0)
    assert k == request_key("teacher@rev1", s, "encode abc =", 0)
    assert k != request_key("teacher@rev2", s, "encode abc =", 0)  # another revision
    assert k != request_key("teacher@rev1", s, "encode abd =", 0)
    assert k != request_key("teacher@rev1", s, "encode abc =", 1)  # another sample
    assert k != request_key("teacher@rev1", Sampling(max_new_tokens=17), "encode abc =", 0)
    assert k != request_key("teacher@rev1", Sampling(max_new_tokens=16, logprobs=5), "encode abc =", 0)
    assert k != request_key("teacher@rev1", s, [{"role": "user", "content": "encode abc ="}], 0)  # chat != raw
    # greedy decoding: seed and top_p cannot change the output, n only adds samples
    assert k == request_key("teacher@rev1", Sampling(max_new_tokens=16, seed=9, top_p=0.5, n=4), "encode abc =", 0)
    hot = Sampling(max_new_tokens=16, temperature=0.7)
    assert request_key("t", hot, "p", 0) != request_key(
        "t", Sampling(max_new_tokens=16, temperature=0.7, seed=1), "p", 0
    )
    reqs = build_requests("t", Sampling(n=3, temperature=1.0, seed=10), ["a", "b"])
    assert [[r.sample_index for r in rs] for rs in reqs] == [[0, 1, 2], [0, 1, 2]]
    assert [r.seed for r in reqs[0]] == [10, 11, 12]


def test_writer_seals_shards_and_lookup_finds_rows(tmp_path):
    cache = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool", shard_rows=3)
    with cache.writer() as w:
        for i in range(7):
            w.add(_row(f"k{i}", f"t{i}"))
    assert len(cache.shards()) == 3  # 3 + 3 + 1
    found = cache.lookup(["k1", "k6", "nope"])
    assert sorted(found) == ["k1", "k6"] and found["k6"]["completion"] == "t6"
    assert found["k1"]["top_logprobs"][0] == [
        {"token_id": 5, "token": None, "logprob": -0.5},
        {"token_id": 6, "token": None, "logprob": -2.5},
    ]
    assert not list((tmp_path / "spool" / "ns").glob("*.jsonl"))  # spools removed once sealed


def _write_then_die(store_root: str, spool: str, n: int) -> None:
    cache = GenerationCache(LocalStore(store_root), "ns", spool, shard_rows=1000)
    w = cache.writer()
    for i in range(n):
        w.add(_row(f"k{i}"))
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no seal: like a killed run


def test_spool_of_a_killed_writer_is_recovered(tmp_path):
    p = mp.get_context("fork").Process(target=_write_then_die, args=(str(tmp_path / "c"), str(tmp_path / "spool"), 25))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    spools = list((tmp_path / "spool" / "ns").glob("*.jsonl"))
    assert len(spools) == 1
    with open(spools[0], "a") as f:
        f.write('{"key": "torn')  # a line cut by the kill
    cache = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool")
    assert cache.shards() == []
    assert cache.recover() == 25
    assert len(cache) == 25 and not spools[0].exists()


def test_live_writer_spool_is_not_stolen(tmp_path):
    cache = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool")
    w = cache.writer()
    w.add(_row("k0"))
    other = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool")
    assert other.recover() == 0  # the lock is held by a live writer
    w.close()
    assert len(other) == 1


def test_compaction_merges_shards_and_drops_duplicate_keys(tmp_path):
    cache = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool", shard_rows=1, max_shards=4)
    with cache.writer() as w:
        for i in range(6):
            w.add(_row(f"k{i % 5}", f"v{i}"))  # k0 twice (a race between two writers)
    assert len(cache.shards()) == 6
    assert cache.compact() == 6
    assert len(cache.shards()) == 1 and len(cache) == 5
    assert cache.lookup(["k0"])["k0"]["completion"] == "v0"  # the first one wins


def test_failed_upload_keeps_rows_in_the_spool(tmp_path):
    class Broken(LocalStore):
        def put(self, key, data):
            raise OSError("disk full")

    cache = GenerationCache(Broken(tmp_path / "c"), "ns", tmp_path / "spool")
    w = cache.writer()
    w.add(_row("k0"))
    with pytest.raises(Exception, match="kept in"):
        w.close()
    ok = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool")
    assert ok.recover() == 1 and len(ok) == 1


@pytest.fixture(scope="module")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    fake = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in fake}
    os.environ.update(fake)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_s3_store_over_http(tmp_path, s3_endpoint):
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket="gens")
    store = open_store("s3://gens/team/cache", endpoint_url=s3_endpoint, region="us-east-1")
    assert isinstance(store, S3Store) and store.url == "s3://gens/team/cache"
    cache = GenerationCache(store, "ns", tmp_path / "spool", shard_rows=2)
    with cache.writer() as w:
        for i in range(5):
            w.add(_row(f"k{i}", f"t{i}"))
    assert len(cache.shards()) == 3
    # a second machine (fresh spool dir) sees the same cache
    other = GenerationCache(open_store("s3://gens/team/cache", endpoint_url=s3_endpoint), "ns", tmp_path / "spool2")
    assert sorted(other.lookup([f"k{i}" for i in range(9)])) == [f"k{i}" for i in range(5)]
    raw = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(
        Bucket="gens", Prefix="team/cache/generations/ns/"
    )
    assert len(raw["Contents"]) == 3
    assert store.exists(cache.shards()[0]) and not store.exists("generations/ns/nope.parquet")
    assert other.compact() == 0


def test_s3_errors_name_the_object(tmp_path, s3_endpoint):
    store = open_store("s3://no-such-bucket/x", endpoint_url=s3_endpoint)
    with pytest.raises(Exception, match="s3://no-such-bucket/x"):
        store.put("generations/ns/a.parquet", b"data")


def test_spool_lines_are_json(tmp_path):
    cache = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool")
    w = cache.writer()
    w.add(_row("k0"))
    spool = next((tmp_path / "spool" / "ns").glob("*.jsonl"))
    assert json.loads(spool.read_text().splitlines()[0])["key"] == "k0"
    w.close()


def test_generation_through_the_storage_resource_on_s3(tmp_path, s3_endpoint):
    import boto3

    from campaign_orchestrator.generation.backends import OpenAIBackend
    from campaign_orchestrator.generation.openai_client import OpenAICompatibleClient
    from campaign_orchestrator.generation.requests import namespace
    from campaign_orchestrator.generation.runner import run_generation
    from resources.storage import ArtifactStore
    from tests.support.testserver import ServerConfig, ServerThread

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket="team-cache")
    rows = [{"id": f"p{i}", "prompt": f"encode {w} ="} for i, w in enumerate(["abc", "hello", "world", "zebra"])]
    s = Sampling(max_new_tokens=16)
    stores = [
        ArtifactStore(
            root=str(tmp_path / f"machine{m}"),
            cache_url="s3://team-cache/gens",
            s3_endpoint_url=s3_endpoint,
            s3_region="us-east-1",
        )
        for m in (1, 2)
    ]
    with ServerThread(ServerConfig(latency_s=0.0)) as srv:
        results = []
        for st in stores:  # two machines, each with its own local root, sharing the S3 cache
            backend = OpenAIBackend(OpenAICompatibleClient(srv.base_url, "teacher"))
            cache = GenerationCache(st.cache_store(), namespace(backend.identity, s), st.spool_dir())
            results.append(run_generation(rows, backend, s, cache))
        assert srv.stats.ok == 4
    assert results[0].stats.generated == 4 and results[1].stats.cache_hits == 4
    assert [r["completion"] for r in results[0].rows] == [r["completion"] for r in results[1].rows]


def test_a_recovery_running_while_a_writer_opens_its_spool_takes_nothing_from_it(tmp_path, monkeypatch):
    """A recoverer (another run over the same spool directory) that lists the spools between a writer's creating
    its spool and locking it must not take the empty file for a dead writer's and remove it under the writer."""
    import fcntl

    from campaign_orchestrator.generation import cache as cache_module

    cache = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool", shard_rows=1000)
    other = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool")
    real_flock, raced = fcntl.flock, []

    def flock_after_a_recovery(fd, op):
        if op == fcntl.LOCK_EX and not raced:  # the writer's blocking lock on its new spool: a recovery runs first
            raced.append(other.recover())
        return real_flock(fd, op)

    monkeypatch.setattr(cache_module.fcntl, "flock", flock_after_a_recovery)
    with cache.writer() as w:
        for i in range(5):
            w.add(_row(f"k{i}"))
    assert raced == [0]
    assert len(cache) == 5 and sorted(cache.lookup([f"k{i}" for i in range(5)])) == [f"k{i}" for i in range(5)]


def test_an_unnamed_spool_is_removed_only_when_stale(tmp_path):
    cache = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool")
    d = tmp_path / "spool" / "ns"
    d.mkdir(parents=True)
    fresh, stale = d / "a.opening", d / "b.opening"
    fresh.touch()
    stale.touch()
    os.utime(stale, (0, 0))  # a writer killed between creating and naming it, long ago
    assert cache.recover() == 0
    assert fresh.exists() and not stale.exists()


# ---------------------------------------------------------------------------------------------- at scale


def _hex_keys(j: int, shards: int, n: int) -> list[str]:
    """``n`` sorted hex keys in shard ``j``'s slice of the key space (as make_shards cuts a stage's requests)."""
    import random

    span, rng = (1 << 256) // shards, random.Random(j)
    return sorted({f"{j * span + rng.randrange(span):064x}" for _ in range(n)})


class _Remote:
    """A store seen from afar: no local paths, so the cache reads it as it reads S3 (ranged GETs); every byte
    read is counted per object."""

    local_path = None

    def __init__(self, root):
        from collections import Counter

        self.inner, self.url, self.read = LocalStore(root), f"remote://{root}", Counter()

    def __getattr__(self, name):  # put, list, delete, exists, download, upload
        return getattr(self.inner, name)

    def get(self, key):
        data = self.inner.get(key)
        self.read[key] += len(data)
        return data

    def read_range(self, key, start, end):
        data = self.inner.read_range(key, start, end)
        self.read[key] += len(data)
        return data

    def read_tail(self, key, n):
        data, size = self.inner.read_tail(key, n)
        self.read[key] += len(data)
        return data, size


def test_a_lookup_reads_only_the_files_and_row_groups_that_can_hold_its_keys(tmp_path, monkeypatch):
    from campaign_orchestrator.generation import cache as cache_module

    monkeypatch.setattr(cache_module, "ROW_GROUP_ROWS", 32)
    monkeypatch.setattr(cache_module, "FOOTER_BYTES", 4096)
    store = _Remote(tmp_path / "c")
    cache = GenerationCache(store, "ns", tmp_path / "spool", shard_rows=10_000, max_shards=4)
    shards = [_hex_keys(j, 20, 60) for j in range(20)]
    for keys in shards:  # one sealed file per shard, as a Ray worker writes it
        with cache.writer() as w:
            for k in keys:
                w.add(_row(k, f"t{k[:8]}"))
    files = cache.shards()
    assert len(files) == 20
    want = shards[7][10:13]
    store.read.clear()
    found = cache.lookup(want + ["f" * 64])
    assert sorted(found) == want and all(found[k]["completion"] == f"t{k[:8]}" for k in want)
    assert len(store.read) == 1  # one file of twenty: the one whose key range holds them (the absent key's none)
    assert cache.compact() == 20
    (run,) = cache.shards()
    size = (tmp_path / "c" / run).stat().st_size
    store.read.clear()
    assert sorted(cache.lookup(want)) == want
    assert 0 < store.read[run] < size / 2, (store.read[run], size)  # the footer, and the row groups that can hold them
    store.read.clear()
    assert sorted(cache.lookup(want)) == want
    assert 0 < store.read[run] < size / 8, (store.read[run], size)  # the footer is known now: only those row groups


def test_compaction_streams_into_key_range_files_and_keeps_the_first_written_row(tmp_path):
    cache = GenerationCache(
        LocalStore(tmp_path / "c"), "ns", tmp_path / "spool", shard_rows=50, max_shards=2, run_bytes=6_000
    )
    keys = [k for j in range(8) for k in _hex_keys(j, 8, 25)]
    with cache.writer() as w:
        for i, k in enumerate(keys):
            w.add(_row(k, "first") | {"created_at": float(i)})
        w.add(_row(keys[3], "second") | {"created_at": 1e9})  # a writer that raced on the same request, later
    assert cache.compact() == 5
    files = [cache_module_parse(f) for f in cache.shards()]
    assert len(files) > 2 and {f.kind for f in files} == {"run"} and len({f.run for f in files}) == 1
    import pyarrow.parquet as pq

    ranges = []
    for f in files:  # each file one sorted key range of about run_bytes, disjoint from the others
        t = pq.read_table(tmp_path / "c" / f.key)
        ks = t["key"].to_pylist()
        assert ks == sorted(ks) and len(ks) == len(set(ks))
        assert pq.read_metadata(tmp_path / "c" / f.key).row_group(0).total_byte_size <= 3 * 6_000
        ranges.append((ks[0], ks[-1]))
    ranges.sort()
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert len(cache) == len(keys)
    got = cache.lookup(keys)
    assert len(got) == len(keys) and got[keys[3]]["completion"] == "first"


def cache_module_parse(key):
    from campaign_orchestrator.generation.cache import parse_name

    return parse_name(key)


def test_a_lookup_racing_a_compaction_finds_every_row(tmp_path, monkeypatch):
    """A compaction in another process replaces the files a lookup has just listed: the lookup lists again."""
    cache = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool", shard_rows=5, max_shards=2)
    keys = _hex_keys(0, 1, 30)
    with cache.writer() as w:
        for k in keys:
            w.add(_row(k))
    other = GenerationCache(LocalStore(tmp_path / "c"), "ns", tmp_path / "spool2", max_shards=2)
    real, raced = GenerationCache._files_for, []

    def listed_then_compacted(self, wanted):
        files = real(self, wanted)
        if not raced:
            raced.append(other.compact())
        return files

    monkeypatch.setattr(GenerationCache, "_files_for", listed_then_compacted)
    assert sorted(cache.lookup(keys)) == keys
    assert raced == [6]


def test_compaction_on_s3_and_a_lookup_from_another_machine(tmp_path, s3_endpoint):
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket="gens2")
    store = open_store("s3://gens2/c", endpoint_url=s3_endpoint, region="us-east-1")
    cache = GenerationCache(store, "ns", tmp_path / "spool", shard_rows=40, max_shards=2, run_bytes=12_000)
    keys = [k for j in range(4) for k in _hex_keys(j, 4, 30)]
    with cache.writer() as w:
        for k in keys:
            w.add(_row(k, k[:6]))
    assert cache.compact() == 3 and len(cache.shards()) > 1
    other = GenerationCache(open_store("s3://gens2/c", endpoint_url=s3_endpoint), "ns", tmp_path / "spool2")
    got = other.lookup(keys[40:50] + ["0" * 64])
    assert sorted(got) == keys[40:50] and all(got[k]["completion"] == k[:6] for k in keys[40:50])
