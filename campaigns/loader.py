"""Read campaign YAML files into validated specs, collecting errors instead of raising.

A broken file never stops the others from loading: :func:`load_campaigns` returns the good
campaigns and one :class:`CampaignFileError` per broken file. Each error names the file, the
field (dotted path), its line in the file, what was found and what was expected.

Every problem of a file is reported at once, sorted by line: keys the schema does not know (with a
"did you mean" among the allowed ones), duplicate keys (YAML would keep the later value silently), values
the schema refuses and, with ``check_files`` (``campaign validate``), data sources and suite files that match
no file and pricing-catalog keys the catalog does not have (with a "did you mean" among its keys), and logit
distillation from an API teacher whose catalog entry says it returns no (or too few) top-k log-probabilities.
"""

from __future__ import annotations

import difflib
import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from campaigns import paths
from campaigns.spec import TEACHER_FORMS, CampaignSpec
from campaigns.spec.common import FieldValueError


@dataclass(frozen=True)
class FieldProblem:
    field: str
    line: int | None
    message: str

    def render(self, file: str) -> str:
        where = f"{file}:{self.line}" if self.line else file
        return f"{where}: {self.field or '(top level)'}: {self.message}"


@dataclass(frozen=True)
class CampaignFileError:
    path: str
    problems: tuple[FieldProblem, ...]

    def render(self) -> str:
        return "\n".join(p.render(self.path) for p in self.problems)


@dataclass
class LoadedCampaigns:
    campaigns: dict[str, CampaignSpec] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # campaign name -> file
    errors: list[CampaignFileError] = field(default_factory=list)


class CampaignError(ValueError):
    """Raised by :func:`load_campaign_file` with the rendered problems as its message."""

    def __init__(self, error: CampaignFileError):
        super().__init__(error.render())
        self.error = error


def default_campaign_files() -> list[str]:
    """The project's ``campaigns/*.yaml`` (:func:`campaigns.paths.default_campaign_files`)."""
    return [str(p) for p in paths.default_campaign_files()]


_display = paths.display


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the deepest YAML node along ``loc`` (a pydantic error location)."""
    best = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == str(part):
                    nxt, best = v, k.start_mark.line + 1
                    break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            best = node.start_mark.line + 1
        else:
            break
        if node is None:
            break
    return best


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last element of ``loc`` (for listing allowed keys)."""
    model: Any = CampaignSpec
    for i, part in enumerate(loc[:-1]):
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = _unwrap(ann, listed=isinstance(loc[i + 1], int))
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(ann: Any, listed: bool = False) -> Any:
    """The model an annotation holds (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``); ``listed``: the
    location goes on with an index, so where a field may be a model or a list of models (``teacher``), the list's."""
    from typing import Annotated, Union

    def leaves(a: Any) -> list[Any]:
        origin = get_origin(a)
        if origin is Annotated:
            return leaves(get_args(a)[0])
        if origin is Union or type(a).__name__ == "UnionType":
            return [x for arg in get_args(a) if arg is not type(None) for x in leaves(arg)]
        return [a]

    options = leaves(ann)
    if listed:
        options = [o for o in options if get_origin(o) is list] or options
    for o in options:
        inner = o
        for _ in range(4):
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                return inner
            args = [a for a in get_args(inner) if a is not type(None)]
            if not args:
                break
            inner = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), args[-1])
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return options[0] if options else ann


def _without_forms(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic location without the tag of the form a field was written in (``teacher``: a mapping or a list)."""
    return tuple(p for i, p in enumerate(loc) if not (i == 1 and loc[0] == "teacher" and p in TEACHER_FORMS))


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean `x`?)`` for the closest of ``choices`` to ``word`` (difflib), else ``""``."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc).replace(".[", "[")


def duplicate_keys(node: yaml.Node | None, loc: tuple[Any, ...] = ()) -> list[FieldProblem]:
    """Every key set twice in one mapping of the YAML tree (PyYAML keeps the later value without a word)."""
    out: list[FieldProblem] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            name, line = str(k.value), k.start_mark.line + 1
            if name in seen:
                out.append(
                    FieldProblem(
                        _dotted((*loc, name)),
                        line,
                        f"duplicate key: already set on line {seen[name]}; YAML would keep only this "
                        "later value: keep one of the two",
                    )
                )
            else:
                seen[name] = line
            out += duplicate_keys(v, (*loc, name))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out += duplicate_keys(v, (*loc, i))
    return out


def _get(data: Any, *loc: Any) -> Any:
    for part in loc:
        if isinstance(part, int) and isinstance(data, list) and part < len(data):
            data = data[part]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return data


def _matches(raw: str, project_dir: Path) -> bool:
    """A data source or suite file (a path, glob or directory) names at least one existing file."""
    p = paths.resolve(raw, project_dir)
    if any(ch in raw for ch in "*?["):
        return any(Path(f).is_file() for f in glob.glob(str(p), recursive=True))
    return p.exists()


def _catalog_keys(data: dict, project_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The pricing catalog's entries by key (the campaign's ``cost.catalog`` or the shipped one), or why not."""
    configured = _get(data, "cost", "catalog")
    path = (
        paths.resolve(configured, project_dir)
        if isinstance(configured, str)
        else paths.shipped_campaigns_dir() / "pricing" / "catalog.yaml"
    )
    try:
        entries = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("entries") or {}
    except (OSError, yaml.YAMLError, AttributeError) as e:
        return None, f"cannot read the pricing catalog {path}: {e}"
    return dict(entries), None


CATALOG_FIELDS = (("teacher", "hardware"), ("teacher", "price"), ("training", "hardware"), ("training", "cpu_hardware"))


def _catalog_fields(data: dict) -> list[tuple[Any, ...]]:
    """:data:`CATALOG_FIELDS`, each teacher's own when ``teacher:`` is a list."""
    teachers = _get(data, "teacher")
    if not isinstance(teachers, list):
        return list(CATALOG_FIELDS)
    out = [loc for loc in CATALOG_FIELDS if loc[0] != "teacher"]
    return [("teacher", i, f) for i in range(len(teachers)) for f in ("hardware", "price")] + out


def file_problems(data: dict, root: yaml.Node | None, project_dir: Path) -> list[FieldProblem]:
    """What a campaign file names that is not there: data sources and suite files that match no file,
    pricing-catalog keys (hardware, teacher price, overrides) the catalog does not have."""
    out: list[FieldProblem] = []

    def missing(loc: tuple[Any, ...], what: str) -> None:
        raw = _get(data, *loc)
        if (
            isinstance(raw, str)
            and not raw.startswith(("s3://", "gs://", "http://", "https://"))
            and not _matches(raw, project_dir)
        ):
            out.append(
                FieldProblem(
                    _dotted(loc),
                    _line_of(root, loc),
                    f"{what} {raw!r} matches no file under {project_dir} (expected an existing file, "
                    "glob or directory, relative to the campaign's project or absolute)",
                )
            )

    missing(("data", "source"), "data source")
    for i, _ in enumerate(_get(data, "dataset", "extra_sources") or []):
        missing(("dataset", "extra_sources", i), "data source")
    for i, suite in enumerate(_get(data, "evaluation", "suites") or []):
        if (
            isinstance(suite, dict)
            and suite.get("kind", "items") == "items"
            and suite.get("source", "heldout") != "heldout"
        ):
            missing(("evaluation", "suites", i, "source"), "suite file")
    keys, why = _catalog_keys(data, project_dir)
    if keys is None:
        out.append(FieldProblem("cost.catalog", _line_of(root, ("cost", "catalog")), why or ""))
        return out
    named = [(loc, _get(data, *loc)) for loc in _catalog_fields(data)]
    named += [(("cost", "overrides", k), k) for k in (_get(data, "cost", "overrides") or {})]
    for loc, value in named:
        if isinstance(value, str) and value != "unpriced" and value not in keys:
            out.append(
                FieldProblem(
                    _dotted(loc),
                    _line_of(root, loc),
                    f"no price entry {value!r} in the pricing catalog{did_you_mean(value, keys)}; "
                    f"expected one of: {', '.join(sorted(keys))}",
                )
            )
    out += _logprobs_problems(data, root, keys)
    return out


def _logprobs_problems(data: dict, root: yaml.Node | None, entries: dict[str, Any]) -> list[FieldProblem]:
    """Logit distillation from an API teacher whose pricing-catalog entry says it returns no top-k
    log-probabilities, or fewer than asked (``top_logprobs``): refused here, before the teacher is paid. An entry
    that does not say is not refused (the client stops at the first answer without them)."""
    teachers = _get(data, "teacher")
    if isinstance(teachers, list):
        return [p for i in range(len(teachers)) for p in _logprobs_problem(data, root, entries, ("teacher", i))]
    return _logprobs_problem(data, root, entries, ("teacher",))


def _logprobs_problem(
    data: dict, root: yaml.Node | None, entries: dict[str, Any], at: tuple[Any, ...]
) -> list[FieldProblem]:
    """:func:`_logprobs_problems` of the teacher section at ``at``."""
    if _get(data, "training", "distillation", "loss") != "logits" or _get(data, *at, "backend") != "openai":
        return []
    price, k = _get(data, *at, "price"), _get(data, *at, "sampling", "logprobs")
    entry = entries.get(price) if isinstance(price, str) else None
    cap = entry.get("top_logprobs") if isinstance(entry, dict) else None
    if not isinstance(cap, int) or not isinstance(k, int) or k <= cap:
        return []
    if cap == 0:
        loc: tuple[Any, ...] = ("training", "distillation", "loss")
        who = "the teacher's" if len(at) == 1 else f"teacher {_get(data, *at, 'name')}'s"
        msg = (
            f"'logits' needs {who} top-k log-probabilities, but its API returns none (pricing-catalog entry "
            f"{price!r}: top_logprobs: 0); nothing to distil from: write `loss: sequence` (and remove "
            f"{_dotted((*at, 'sampling', 'logprobs'))}), or use a teacher that returns log-probabilities"
        )
    else:
        loc = (*at, "sampling", "logprobs")
        msg = (
            f"asks for the top {k} log-probabilities, but the teacher's API returns at most {cap} (pricing-catalog "
            f"entry {price!r}: top_logprobs: {cap}): write `logprobs: {cap}` or less"
        )
    return [FieldProblem(_dotted(loc), _line_of(root, loc), msg)]


def _problems(exc: ValidationError, root: yaml.Node | None) -> list[FieldProblem]:
    out = []
    for err in exc.errors():
        loc = _without_forms(tuple(err["loc"]))
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldValueError):  # a campaign-wide rule that names the field it is broken at
            out.append(FieldProblem(_dotted(cause.loc), _line_of(root, cause.loc), str(cause)))
            continue
        dotted = _dotted(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            owner = _model_at(loc)
            names = [f.alias or n for n, f in owner.model_fields.items()] if owner else []
            allowed = ", ".join(names) if owner else "see campaigns/spec/"
            hint = did_you_mean(loc[-1], names)
            hint = f"; {hint.removesuffix(')').removeprefix(' (')}" if hint else ""
            msg = f"unknown key; expected one of: {allowed}{hint}"
        elif kind == "missing":
            msg = "required field is missing"
        else:
            got = err.get("input")
            msg = err["msg"].removeprefix("Value error, ")
            # Our own validators already quote the value ("..., got 'x'"); pydantic's messages do not.
            shown = "" if isinstance(got, dict | list) or f"got {got!r}" in msg else f" (got {got!r})"
            msg = f"{msg}{shown}"
        out.append(FieldProblem(dotted, _line_of(root, loc), msg))
    return out


def parse_campaign_text(text: str, path: str = "<string>", project_dir: Path | None = None) -> CampaignSpec:
    """Validate YAML text; raise :class:`CampaignError` naming file, field and expectation of every problem
    found (``project_dir``: also look for the files and catalog keys it names, :func:`file_problems`)."""
    shown = path if path == "<string>" else _display(path)
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        raise CampaignError(CampaignFileError(shown, (FieldProblem("", line, f"not valid YAML: {e}"),))) from None
    if not isinstance(data, dict):
        raise CampaignError(
            CampaignFileError(
                shown, (FieldProblem("", 1, f"expected a mapping of campaign fields, got {type(data).__name__}"),)
            )
        )
    problems = duplicate_keys(root)
    if project_dir is not None:
        problems += file_problems(data, root, project_dir)
    spec = None
    try:
        spec = CampaignSpec.model_validate(data)
    except ValidationError as e:
        problems += _problems(e, root)
    if problems:
        raise CampaignError(CampaignFileError(shown, tuple(sorted(problems, key=lambda p: (p.line or 0, p.field)))))
    return spec


def load_campaign_file(path: str | os.PathLike, check_files: bool = False) -> CampaignSpec:
    """The campaign in ``path``; ``check_files``: also report the files and catalog keys it names that are not
    there (``campaign validate``; a run finds them when the stage reads them)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CampaignError(
            CampaignFileError(_display(p), (FieldProblem("", None, f"cannot read file: {e}"),))
        ) from None
    spec = parse_campaign_text(text, str(p), paths.campaign_project_dir(p) if check_files else None)
    spec.set_project_dir(paths.campaign_project_dir(p))
    return spec


def load_campaigns(paths: list[str] | None = None, check_files: bool = False) -> LoadedCampaigns:
    """Load every campaign file; never raises for a bad file (``check_files``: see :func:`load_campaign_file`)."""
    result = LoadedCampaigns()
    for path in paths if paths is not None else default_campaign_files():
        try:
            spec = load_campaign_file(path, check_files)
        except CampaignError as e:
            result.errors.append(e.error)
            continue
        if spec.name in result.campaigns:
            result.errors.append(
                CampaignFileError(
                    _display(path),
                    (
                        FieldProblem(
                            "name", None, f"campaign {spec.name!r} is already defined in {result.sources[spec.name]}"
                        ),
                    ),
                )
            )
            continue
        result.campaigns[spec.name] = spec
        result.sources[spec.name] = _display(path)
    return result


def resolve_campaign(name_or_file: str) -> tuple[CampaignSpec, str]:
    """A campaign by name (among ``campaigns/*.yaml``) or by file path."""
    if os.path.exists(name_or_file):
        return load_campaign_file(name_or_file), _display(name_or_file)
    loaded = load_campaigns()
    if name_or_file in loaded.campaigns:
        return loaded.campaigns[name_or_file], loaded.sources[name_or_file]
    broken = [e for e in loaded.errors if Path(e.path).stem == name_or_file]
    if broken:
        raise CampaignError(broken[0])
    known = ", ".join(sorted(loaded.campaigns)) or "none"
    raise KeyError(f"no campaign named {name_or_file!r} (known: {known}); pass a campaign name or a YAML file path")
