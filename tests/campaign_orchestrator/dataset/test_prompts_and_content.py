"""Prompt sources, the held-out split and content-keyed stage directories."""

import json

import pytest

from campaign_orchestrator.content import dir_sha256, value_sha256
from campaign_orchestrator.dataset.prompts import PromptSourceError, read_prompts, source_files, split
from campaign_orchestrator.demo import cipher
from campaign_orchestrator.stage_dir import StageDir


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_split_is_deterministic_and_stable_when_data_grows(tmp_path):
    rows = cipher.items(500, seed=3)
    train, held = split(rows, 0.2, seed=0)
    assert 60 < len(held) < 140 and len(train) + len(held) == 500
    assert {r["id"] for r in held}.isdisjoint(r["id"] for r in train)
    more = rows + cipher.items(200, seed=4, id_prefix="q")
    _, held2 = split(more, 0.2, seed=0)
    assert {r["id"] for r in held} <= {r["id"] for r in held2}  # new files never move old items
    _, capped = split(rows, 0.2, seed=0, max_items=10)
    assert len(capped) == 10


def test_glob_reads_every_file_in_order(tmp_path):
    _write(tmp_path / "a.jsonl", cipher.items(3, seed=1, id_prefix="a"))
    _write(tmp_path / "b.jsonl", cipher.items(2, seed=2, id_prefix="b"))
    rows = read_prompts(source_files(str(tmp_path / "*.jsonl"), "/"))
    assert [r["id"] for r in rows] == ["a000000", "a000001", "a000002", "b000000", "b000001"]
    assert rows[0]["category"] in {"short", "long"} and rows[0]["source_file"] == "a.jsonl"


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"", "the source is empty"),
        (b'{"id": 1, "prompt": "x"}\n\xff\xfe\n', ":2: not valid UTF-8"),
        (b'{"id": 1, "prompt": ""}\n', "field 'prompt' must be a non-empty string"),
        (b'{"id": 1, "text": "hello"}\n', "field 'prompt' must be a non-empty string"),
        (b'{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "duplicate id '1'"),
        (b"[1, 2]\n", "expected a JSON object"),
        (b"{oops\n", ":1: not valid JSON"),
    ],
)
def test_bad_prompt_files_are_clear_errors(tmp_path, content, expected):
    f = tmp_path / "p.jsonl"
    f.write_bytes(content)
    with pytest.raises(PromptSourceError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        read_prompts([f])


def test_missing_source_names_the_pattern(tmp_path):
    with pytest.raises(PromptSourceError, match="no files match"):
        source_files("nowhere/*.jsonl", tmp_path)


def test_stage_dir_commit_marks_complete_last(tmp_path):
    sd = StageDir(tmp_path, "c", "stage", "k1")
    assert not sd.is_complete()
    (sd.ensure() / "data.txt").write_text("x")
    assert not sd.is_complete()  # files alone are not a finished stage
    m = sd.commit({"rows": 1})
    assert sd.is_complete() and sd.manifest() == m and m["path"] == str(sd.path)


def test_hashes_depend_on_content_not_order(tmp_path):
    assert value_sha256({"a": 1, "b": 2}) == value_sha256({"b": 2, "a": 1})
    (tmp_path / "x").write_text("1")
    h1 = dir_sha256(tmp_path)
    (tmp_path / "x").write_text("2")
    assert dir_sha256(tmp_path) != h1


def test_cipher_task_is_exact_and_categorized():
    items = cipher.items(50, seed=5)
    assert len({i["prompt"] for i in items}) == 50
    for it in items:
        word = it["prompt"].split()[1]
        assert it["reference"] == cipher.encode(word) and len(it["reference"]) == len(word)
        assert it["category"] == ("short" if len(word) <= 5 else "long")
    assert sorted(cipher.CIPHER.values()) == sorted(cipher.CIPHER)  # a permutation
