"""teacher_generations and distillation_set through Dagster, with the openai backend calling a
real local server that serves the demo teacher; plus the standalone CLI's bad-input answers
and a SIGKILL in the middle of a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dagster import materialize

from assets import distillation_set as distillation
from assets import prompts
from assets import teacher_generations as generations
from assets.location import default_resources
from campaign_orchestrator.demo import cipher
from campaign_orchestrator.teacher import __main__ as gen_cli
from campaigns.loader import parse_campaign_text
from tests.support import REPO_ROOT as REPO
from tests.support.testserver import ServerConfig, ServerThread

SECRET = "sk-campaign-secret-4242424242"


def _campaign(name: str, source: Path, base_url: str) -> str:
    return f"""
name: {name}
teacher:
  backend: openai
  model: teacher
  base_url: "{base_url}"
  api_key_env: TEST_TEACHER_KEY
  max_concurrency: 8
  price: api-open-70b
  sampling: {{max_new_tokens: 16}}
student: {{base_model: "@demo/student"}}
data:
  source: "{source}"
  heldout: {{fraction: 0.1}}
  filters: {{format_regex: "[a-z]+", scorer: exact_match}}
training: {{max_steps: 1, hardware: cpu-2vcpu}}
evaluation: {{suites: [{{name: cipher}}]}}
"""


def _write_prompts(path: Path, n: int) -> Path:
    return cipher.write_jsonl(cipher.items(n, seed=77, id_prefix="g"), path)


def _materialize(spec, root: Path):
    return materialize(
        [prompts.build(spec), generations.build(spec), distillation.build(spec)],
        resources=default_resources(str(root)),
        raise_on_error=True,
    )


def _metadata(result, stage: str) -> dict:
    mats = [m for m in result.asset_materializations_for_node(f"{stage}") or []]
    return {k: v.value for k, v in mats[-1].metadata.items()}


def test_openai_campaign_is_cached_across_campaigns_and_priced(tmp_path, artifact_root, demo_models, monkeypatch):
    src = _write_prompts(tmp_path / "prompts.jsonl", 40)
    monkeypatch.setenv("TEST_TEACHER_KEY", SECRET)
    cfg = ServerConfig(latency_s=0.0, responder="model", model_dir=str(demo_models["teacher"]), api_key=SECRET)
    with ServerThread(cfg) as srv:
        spec = parse_campaign_text(_campaign("gen_a", src, srv.base_url))
        res = _materialize(spec, artifact_root)
        first_requests = srv.stats.received
        md = _metadata(res, "gen_a__teacher_generations")
        spec_b = parse_campaign_text(_campaign("gen_b", src, srv.base_url))  # another campaign, same requests
        res_b = _materialize(spec_b, artifact_root)
        assert srv.stats.received == first_requests  # nothing asked twice
    man = json.loads((artifact_root / "gen_a" / "teacher_generations" / "LATEST.json").read_text())
    rows = pq.read_table(man["generations_path"]).to_pylist()
    assert md["new_generations"] == len(rows) == first_requests and md["cache_hits"] == 0
    assert sum(r["completion"].strip() == cipher.encode(r["prompt"].split()[1]) for r in rows) >= len(rows) - 2
    assert all(r["backend"] == "openai" and r["prompt_tokens"] > 0 for r in rows)
    tok = man["prompt_tokens"] + man["completion_tokens"]
    assert [line["price_key"] for line in man["cost_lines"]] == ["api-open-70b:input", "api-open-70b:output"]
    assert sum(line["usd"] for line in man["cost_lines"]) == pytest.approx(tok / 1e6 * 0.88)
    md_b = _metadata(res_b, "gen_b__teacher_generations")
    assert md_b["cache_hits"] == len(rows) and md_b["new_generations"] == 0 and md_b["cost"] == "$0"
    dist = _metadata(res, "gen_a__distillation_set")
    assert dist["rows"] + dist["dropped_scorer"] + dist["dropped_format"] == len(rows)
    # the key never lands in manifests, metadata or the cache
    for p in artifact_root.rglob("*"):
        if p.is_file() and not p.is_symlink() and "models" not in p.parts:
            assert SECRET.encode() not in p.read_bytes(), p
    assert SECRET not in json.dumps(md, default=str)


def test_missing_api_key_variable_is_named(tmp_path, artifact_root, monkeypatch):
    src = _write_prompts(tmp_path / "prompts.jsonl", 12)
    monkeypatch.delenv("TEST_TEACHER_KEY", raising=False)
    spec = parse_campaign_text(_campaign("gen_nokey", src, "http://127.0.0.1:9/v1"))
    with pytest.raises(Exception, match="TEST_TEACHER_KEY.*not set"):
        _materialize(spec, artifact_root)


def test_cli_bad_input_is_a_clear_error(tmp_path, capsys):
    teacher = '{backend: openai, model: teacher, base_url: "http://127.0.0.1:9/v1"}'
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert gen_cli.main(["--prompts", str(empty), "--teacher", teacher, "--out", str(tmp_path / "o.parquet")]) == 1
    assert "the source is empty" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": "a", "prompt": "encode abc ="}\n{"id": "b", "prompt": "caf\xe9"}\n')
    assert gen_cli.main(["--prompts", str(bad), "--teacher", teacher, "--out", str(tmp_path / "o.parquet")]) == 1
    assert "bad.jsonl:2: not valid UTF-8" in capsys.readouterr().err
    assert gen_cli.main(["--prompts", str(bad), "--teacher", "{backend: openai, model: m}", "--out", "x"]) == 1
    assert "needs `base_url`" in capsys.readouterr().err
    good = _write_prompts(tmp_path / "good.jsonl", 3)
    t0 = time.perf_counter()  # nothing listens on port 9: an error after the retries, not a hang
    rc = gen_cli.main(
        [
            "--prompts",
            str(good),
            "--teacher",
            teacher[:-1] + ", max_retries: 1}",
            "--out",
            "x",
            "--artifacts",
            str(tmp_path / "a"),
            "--quiet",
        ]
    )
    assert rc == 2 and "cannot connect" in capsys.readouterr().err and time.perf_counter() - t0 < 30


def test_sigkill_mid_run_then_rerun_asks_only_what_is_missing(tmp_path):
    n = 400
    src = _write_prompts(tmp_path / "prompts.jsonl", n)
    out = tmp_path / "gens.parquet"
    with ServerThread(ServerConfig(latency_s=0.03)) as srv:
        teacher = json.dumps({"backend": "openai", "model": "teacher", "base_url": srv.base_url, "max_concurrency": 8})
        cmd = [
            sys.executable,
            "-m",
            "campaign_orchestrator.teacher",
            "--prompts",
            str(src),
            "--teacher",
            teacher,
            "--out",
            str(out),
            "--artifacts",
            str(tmp_path / "art"),
            "--quiet",
        ]
        env = os.environ | {"PYTHONPATH": str(REPO)}
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while srv.stats.ok < 100 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        first = srv.stats.ok
        assert 100 <= first < n, proc.stderr.read().decode()[-2000:]
        srv.stats.received_by_prompt.clear()
        before = srv.stats.received
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        stats = json.loads(done.stdout)
        second = srv.stats.received - before
    assert stats["cache_hits"] + stats["generated"] == n
    assert stats["recovered_rows"] > 0  # the killed run's spool was sealed by the rerun
    assert second == stats["generated"] == n - stats["cache_hits"]  # the server saw only the missing ones
    assert first + second - n <= 8  # at most the requests in flight at the kill were paid twice
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(f"g{i:06d}" for i in range(n))  # each prompt exactly once


def test_spec_refuses_a_key_in_api_key_env_without_echoing_it(tmp_path):
    from campaigns.loader import CampaignError

    text = _campaign("gen_bad", tmp_path / "p.jsonl", "http://h/v1").replace("TEST_TEACHER_KEY", SECRET)
    with pytest.raises(CampaignError) as e:
        parse_campaign_text(text)
    assert "*name* of an environment variable" in str(e.value) and SECRET not in str(e.value)
    with pytest.raises(CampaignError, match="chat: true"):
        parse_campaign_text(
            _campaign("gen_chat", tmp_path / "p.jsonl", "h").replace(
                "backend: openai", "backend: transformers\n  chat: true"
            )
        )
