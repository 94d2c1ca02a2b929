"""evaluation/promotion.py: the promoted folder's records hold no absolute path; the base's files stay as copied."""

from __future__ import annotations

import json

from evaluation.promotion import make_portable, portable
from tests.support.promoted_support import absolute_paths_in


def test_paths_become_relative_to_the_deepest_root_or_their_name():
    roots = ["/srv/project", "/srv/project/artifacts"]
    assert portable("/srv/project/artifacts/models/gguf/ab12", roots) == "models/gguf/ab12"
    assert portable("/srv/project/campaigns/data/demo/*.jsonl", roots) == "campaigns/data/demo/*.jsonl"
    assert portable("the base with the adapter /home/ann/x/adapter", roots) == "the base with the adapter adapter"
    assert portable("/srv/project", roots) == "."
    for kept in ("http://127.0.0.1:8011/v1", "tokens/s", "@demo/student", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert portable(kept, roots) == kept


def test_the_records_are_rewritten_and_the_base_files_are_not(tmp_path):
    root = tmp_path / "artifacts"
    folder = root / "demo" / "promoted_model" / "k"
    (folder / "adapter").mkdir(parents=True)
    base = root / "models" / "demo-1" / "student"
    (folder / "promotion.json").write_text(json.dumps({"base_model_path": str(base), "run_id": "r"}))
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "r": 4}))
    (folder / "adapter" / "reproducibility.json").write_text(
        json.dumps({"base_model": str(base), "dataset": str(root / "demo" / "tokenized_dataset" / "x" / "train")})
    )
    vocab = {"model": {"vocab": {"/api": 5, "/usr/bin": 6}}}  # tokens that look like paths: a vocabulary's own
    (folder / "adapter" / "tokenizer.json").write_text(json.dumps(vocab))
    changed = make_portable(folder, [root, tmp_path], "@demo/student")
    assert sorted(p.name for p in changed) == ["adapter_config.json", "promotion.json", "reproducibility.json"]
    assert json.loads((folder / "promotion.json").read_text())["base_model_path"] == "models/demo-1/student"
    assert json.loads((folder / "adapter" / "adapter_config.json").read_text()) == {
        "base_model_name_or_path": "@demo/student",
        "r": 4,
    }
    assert json.loads((folder / "adapter" / "reproducibility.json").read_text())["dataset"] == (
        "demo/tokenized_dataset/x/train"
    )
    assert json.loads((folder / "adapter" / "tokenizer.json").read_text()) == vocab
    assert absolute_paths_in(folder, [tmp_path]) == []
