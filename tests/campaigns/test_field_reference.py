"""The campaign field reference is generated from the spec and checked in current."""

from __future__ import annotations

from campaigns import fieldref
from campaigns.spec import CampaignSpec


def test_checked_in_reference_is_current():
    assert fieldref.is_current(), "docs/campaign-fields.md is out of date: run `.venv/bin/campaign docs` and commit it"


def test_reference_lists_every_field_of_every_section():
    text = fieldref.render()
    for name in CampaignSpec.model_fields:
        assert f"| `{name}` |" in text
    # nested sections get their own table, with their fields
    assert "## `training.distillation`" in text and "| `kl_weight` |" in text
    assert "## `evaluation.gate`" in text


def test_every_field_is_described():
    undocumented = [line for line in fieldref.render().splitlines() if line.startswith("| `") and line.endswith("|  |")]
    assert not undocumented, "fields without a description (add `description=` where they are declared):\n" + "\n".join(
        undocumented
    )


def test_stale_reference_is_detected(tmp_path):
    p = tmp_path / "fields.md"
    fieldref.write(p)
    assert fieldref.is_current(p)
    p.write_text(p.read_text().replace("| `name` |", "| `nom` |"))
    assert not fieldref.is_current(p)
