"""The one ``s3://`` URL parser (campaigns/object_store.py): what it accepts, what it refuses, and that no other
module parses these URLs by hand."""

from __future__ import annotations

import re

import pytest

from campaigns.object_store import S3Url, is_s3_url, parse_s3_url
from tests.support import REPO_ROOT

LIBRARY = ("campaigns", "assets", "resources", "training", "evaluation", "campaign_orchestrator", "campaign_app")


@pytest.mark.parametrize(
    "url, expected",
    [
        ("s3://ckpts/runs/demo/abc", ("ckpts", "runs/demo/abc")),
        ("s3://ckpts/runs/demo/abc/", ("ckpts", "runs/demo/abc")),
        ("s3://ckpts", ("ckpts", "")),
        ("s3://my.bucket-1/", ("my.bucket-1", "")),
        ("s3://drops/cipher/*.jsonl", ("drops", "cipher/*.jsonl")),
    ],
)
def test_parse_s3_url(url, expected):
    assert parse_s3_url(url) == expected
    assert str(S3Url(*expected)) == url.rstrip("/")


@pytest.mark.parametrize("url", ["s3://", "s3:///key", "s3://Upper/key", "s3://ab/key", "file:///x", "ckpts/runs"])
def test_parse_s3_url_refuses_what_is_not_one_and_names_the_field(url):
    with pytest.raises(ValueError, match=r"checkpoint_uri .* expected s3://bucket\[/prefix\]"):
        parse_s3_url(url, "checkpoint_uri")


def test_join_and_is_s3_url():
    assert parse_s3_url("s3://bkt/runs/").join("x/y.json") == "runs/x/y.json"
    assert parse_s3_url("s3://bkt").join("", "y.json") == "y.json"
    assert is_s3_url("s3://bkt/k") and not is_s3_url("/data/s3://bkt")


def test_no_other_module_parses_s3_urls():
    """A hand-written split of ``s3://`` (a regex, ``urlparse``, slicing off the scheme) outside the one parser."""
    by_hand = re.compile(r"""re\.(match|compile|fullmatch)\(r?["']\^?s3://|urlparse\(|len\(["']s3://["']\)""")
    found = [
        f"{f.relative_to(REPO_ROOT)}: {line.strip()}"
        for pkg in LIBRARY
        for f in sorted((REPO_ROOT / pkg).rglob("*.py"))
        if f.name != "object_store.py"
        if "s3://" in (text := f.read_text())
        for line in text.splitlines()
        if by_hand.search(line)
    ]
    assert found == []
