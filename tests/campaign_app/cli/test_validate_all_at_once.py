"""`campaign validate` reports every problem of a file in one pass: file, line, field, what was expected, and a
"did you mean" for near-miss keys and catalog names."""

from campaign_app.cli import main
from tests.support import REPO_ROOT as REPO


def _planted(tmp_path):
    """The demo campaign with four mistakes: a misspelled key, a duplicate key, a data source that matches no
    file and a hardware key the pricing catalog does not have."""
    text = (REPO / "campaigns" / "demo.yaml").read_text()
    for old, new in (
        ("  learning_rate: 5.0e-3", "  learnin_rate: 5.0e-3"),
        ("  warmup_steps: 5", "  warmup_steps: 5\n  max_steps: 10"),
        ("source: campaigns/data/demo/*.jsonl", "source: campaigns/data/nowhere/*.jsonl"),
        (
            "  launcher: local                # local | k8s\n  hardware: cpu-2vcpu",
            "  launcher: local                # local | k8s\n  hardware: cpu-2vpcu",
        ),
    ):
        assert old in text, old
        text = text.replace(old, new, 1)
    f = tmp_path / "campaigns" / "planted.yaml"
    f.parent.mkdir()
    f.write_text(text)
    return f, text.splitlines()


def _line(lines: list[str], needle: str, nth: int = 0) -> int:
    return [i + 1 for i, x in enumerate(lines) if needle in x][nth]


def test_four_planted_mistakes_are_reported_in_one_run(tmp_path, capsys):
    f, lines = _planted(tmp_path)
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out
    problems = [x.strip() for x in out.splitlines() if x.strip().startswith(str(f))]
    assert len(problems) == 4, out
    by_field = {p.split(": ")[1]: p for p in problems}
    assert by_field["training.learnin_rate"].startswith(f"{f}:{_line(lines, 'learnin_rate')}:")
    assert "unknown key; expected one of: " in by_field["training.learnin_rate"]
    assert by_field["training.learnin_rate"].endswith("; did you mean `learning_rate`?")
    dup = by_field["training.max_steps"]
    assert dup.startswith(f"{f}:{_line(lines, 'max_steps', 1)}:")
    assert f"duplicate key: already set on line {_line(lines, 'max_steps')}" in dup
    assert f"{f}:{_line(lines, 'nowhere')}:" in by_field["data.source"] and "matches no file" in by_field["data.source"]
    hw = by_field["training.hardware"]
    assert hw.startswith(f"{f}:{_line(lines, 'cpu-2vpcu')}:")
    assert "no price entry 'cpu-2vpcu' in the pricing catalog (did you mean `cpu-2vcpu`?)" in hw
    assert out.count("cpu-2vpcu") == 1  # the hardware typo once, with its file and line


def test_a_missing_suite_file_and_an_unknown_teacher_key_are_found_at_validation(tmp_path, capsys):
    f, _ = _planted(tmp_path)
    text = (REPO / "campaigns" / "demo.yaml").read_text()
    text = text.replace("  hardware: cpu-2vcpu\n", "  hardware: cpu-2vcpuu\n", 1)
    text = text.replace(
        "      source: heldout\n      scorer: regex", "      source: suites/gone.jsonl\n      scorer: regex"
    )
    f.write_text(text)
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out
    assert "teacher.hardware: no price entry 'cpu-2vcpuu'" in out and "(did you mean `cpu-2vcpu`?)" in out
    assert "evaluation.suites[1].source: suite file 'suites/gone.jsonl' matches no file" in out
