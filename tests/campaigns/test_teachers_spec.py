"""Several teachers at validation (issue 45): `teacher:` as a list routed by category. The shipped demo validates
and routes; what a list cannot mean, or what cannot work with one yet (on-policy distillation, one
`teacher_tokenizer`), is refused by `campaign validate` naming the file, line and field, before anything is paid; a
sweep of the training settings works with several teachers (the dataset it sweeps over is built once) and
validates. A single teacher's campaign reads as before (one teacher named `teacher`, the campaign its own view)."""

from __future__ import annotations

import pytest
import yaml

from campaign_app.cli import main
from campaigns.loader import load_campaign_file, parse_campaign_text
from tests.support import REPO_ROOT as REPO

SHIPPED = REPO / "campaigns" / "demo_teachers.yaml"


def test_the_shipped_two_teacher_demo_validates_and_routes_by_category(capsys):
    assert main(["validate", str(SHIPPED)]) == 0
    spec = load_campaign_file(SHIPPED)
    assert spec.several_teachers and [e.name for e in spec.teachers] == ["short", "general"]
    assert spec.teacher_for("short").name == "short"
    assert spec.teacher_for("long").name == spec.teacher_for(None).name == "general"  # the default takes the rest
    view = spec.for_teacher("short")
    assert not view.several_teachers and view.teacher.sampling.max_new_tokens == 8
    assert spec.teacher.default.name == "general" and spec.teacher.sampling.max_new_tokens == 16


def test_a_single_teacher_is_one_entry_named_teacher_and_its_own_view():
    spec = load_campaign_file(REPO / "campaigns" / "demo.yaml")
    assert not spec.several_teachers
    (only,) = spec.teachers
    assert only.name == "teacher" and only.categories is None and only.model == spec.teacher.model
    assert spec.for_teacher(only) is spec and spec.teacher_for("short") == only
    # written back as it was read: a mapping, not a list
    assert isinstance(spec.model_dump()["teacher"], dict)


def _write(tmp_path, change) -> tuple:
    spec = yaml.safe_load(SHIPPED.read_text())
    spec["data"]["source"] = str(REPO / "campaigns" / "data" / "demo" / "*.jsonl")
    change(spec)
    f = tmp_path / "campaigns" / "teachers.yaml"
    f.parent.mkdir(exist_ok=True)
    text = yaml.safe_dump(spec, sort_keys=False)
    f.write_text(text)
    return f, text.splitlines()


def _line(lines: list[str], needle: str, after: str | None = None) -> int:
    start = 0 if after is None else next(i for i, x in enumerate(lines) if after in x)
    return next(i + 1 for i, x in enumerate(lines) if i >= start and needle in x)


def _no_default(s):
    s["teacher"][1]["categories"] = ["long"]


def _two_defaults(s):
    del s["teacher"][0]["categories"]


def _twice_routed(s):
    s["teacher"][1]["categories"] = ["short"]
    s["teacher"].append(dict(s["teacher"][0], name="third", categories=None))
    del s["teacher"][2]["categories"]


def _same_name(s):
    s["teacher"][1]["name"] = "short"


def _bad_name(s):
    s["teacher"][1]["name"] = "General Teacher"


def _empty_categories(s):
    s["teacher"][0]["categories"] = []


def _share_without_budget(s):
    s["cost"].pop("budget_usd")


def _on_policy(s):
    s["training"]["distillation"] = {"loss": "on_policy", "on_policy": {"samples_per_round": 24}}


def _one_tokenizer(s):
    s["training"]["distillation"] = {"loss": "logits", "teacher_tokenizer": "@demo/teacher"}
    for e in s["teacher"]:
        e["sampling"]["logprobs"] = 4


def _logits_without_logprobs(s):
    s["training"]["distillation"] = {"loss": "logits"}
    s["teacher"][0]["sampling"]["logprobs"] = 4  # the second teacher has none


REFUSALS = [
    (_no_default, ("teacher:", None), "teacher: exactly one teacher of the list leaves `categories` unset"),
    (_two_defaults, ("teacher:", None), "teacher[0] (short) and teacher[1] (general) both do"),
    (_twice_routed, ("teacher:", None), "category 'short' is routed to two teachers (short and general)"),
    (_same_name, ("teacher:", None), "teacher names must be unique: short named twice"),
    (_bad_name, ("name: General Teacher", None), "teacher[1]: `name` must be a slug"),
    (_empty_categories, ("categories: []", None), "`categories: []` routes no prompt to this teacher"),
    (
        _share_without_budget,
        ("budget_share:", None),
        "teacher[0].budget_share: teacher short's budget_share is a share of the teacher budget, but the campaign "
        "has none",
    ),
    (
        _on_policy,
        ("loss: on_policy", None),
        "training.distillation.loss: 'on_policy' scores the student's samples with one teacher",
    ),
    (_one_tokenizer, ("teacher_tokenizer:", None), "training.distillation.teacher_tokenizer: names one tokenizer"),
    (
        _logits_without_logprobs,
        ("sampling:", "name: general"),
        "teacher[1].sampling: training.distillation.loss 'logits' needs every teacher's top-k log-probabilities; "
        "teacher general has none",
    ),
]


@pytest.mark.parametrize("change,where,message", REFUSALS, ids=[c.__name__.strip("_") for c, _w, _m in REFUSALS])
def test_what_a_list_of_teachers_cannot_mean_is_refused_naming_file_line_and_field(
    tmp_path, capsys, change, where, message
):
    f, lines = _write(tmp_path, change)
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out
    assert f"{f}:{_line(lines, *where)}: " in out, out
    assert message in out, out


def test_a_sweep_with_several_teachers_validates():
    """A sweep changes training and LoRA settings only, over the one tokenized dataset every trial reads; which
    teacher answered a row is fixed before it."""
    sweep = yaml.safe_load((REPO / "campaigns" / "demo_sweep.yaml").read_text())
    teachers = yaml.safe_load(SHIPPED.read_text())["teacher"]
    sweep["teacher"] = teachers
    spec = parse_campaign_text(yaml.safe_dump(sweep), project_dir=REPO)
    assert spec.sweep is not None and [e.name for e in spec.teachers] == ["short", "general"]
