"""Read campaign YAML files into validated specs, collecting errors instead of raising.

A broken file never stops the others from loading: :func:`load_campaigns` returns the good
campaigns and one :class:`CampaignFileError` per broken file. Each error names the file, the
field (dotted path), its line in the file, what was found and what was expected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from campaigns import paths
from campaigns.spec import CampaignSpec


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
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = _unwrap(ann)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(ann: Any) -> Any:
    for _ in range(4):
        args = [a for a in get_args(ann) if a is not type(None)]
        if get_origin(ann) is None or not args:
            return ann
        ann = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), args[0])
    return ann


def _problems(exc: ValidationError, root: yaml.Node | None) -> list[FieldProblem]:
    out = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        dotted = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc).replace(".[", "[")
        kind = err["type"]
        if kind == "extra_forbidden":
            owner = _model_at(loc)
            allowed = ", ".join(f.alias or n for n, f in owner.model_fields.items()) if owner else "see campaigns/spec/"
            msg = f"unknown key; expected one of: {allowed}"
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


def parse_campaign_text(text: str, path: str = "<string>") -> CampaignSpec:
    """Validate YAML text; raise :class:`CampaignError` naming file, field and expectation."""
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
            CampaignFileError(shown, (FieldProblem("", 1, f"expected a mapping of campaign fields, got {type(data).__name__}"),))
        )
    try:
        return CampaignSpec.model_validate(data)
    except ValidationError as e:
        raise CampaignError(CampaignFileError(shown, tuple(_problems(e, root)))) from None


def load_campaign_file(path: str | os.PathLike) -> CampaignSpec:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CampaignError(CampaignFileError(_display(p), (FieldProblem("", None, f"cannot read file: {e}"),))) from None
    spec = parse_campaign_text(text, str(p))
    spec.set_project_dir(paths.campaign_project_dir(p))
    return spec


def load_campaigns(paths: list[str] | None = None) -> LoadedCampaigns:
    """Load every campaign file; never raises for a bad file."""
    result = LoadedCampaigns()
    for path in paths if paths is not None else default_campaign_files():
        try:
            spec = load_campaign_file(path)
        except CampaignError as e:
            result.errors.append(e.error)
            continue
        if spec.name in result.campaigns:
            result.errors.append(
                CampaignFileError(
                    _display(path),
                    (FieldProblem("name", None, f"campaign {spec.name!r} is already defined in {result.sources[spec.name]}"),),
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
