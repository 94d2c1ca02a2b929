"""The campaign field reference (``docs/campaign-fields.md``), generated from the spec's documented fields.

Every field of :class:`campaigns.spec.CampaignSpec` is documented where it is declared (its pydantic
``description``); this module walks the models and writes one table per section, so the reference can
never drift from what ``campaign validate`` accepts. ``campaign docs`` writes it; ``campaign docs --check``
(and ``tests/campaigns/test_field_reference.py``) fails when the checked-in file is not current.
Imports only pydantic and the spec.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from campaigns import paths

HEADER = """# Campaign field reference

Generated from the field descriptions in `campaigns/spec/` by `campaign docs` (do not edit by hand:
`tests/campaigns/test_field_reference.py` fails when this file is not current). Unknown keys are
errors; `campaign validate` names the file, line, field and what was expected.
"""


def reference_path() -> Path:
    return paths.project_dir() / "docs" / "campaign-fields.md"


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X``, ``X | None``, ``list[X]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        for m in _models_in(arg):
            if m not in out:
                out.append(m)
    return out


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " | ".join(f"`{json.dumps(a)}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return annotation.__name__
        if issubclass(annotation, enum.Enum):
            return " | ".join(f"`{m.value}`" for m in annotation)
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    if f.default_factory is not None:
        try:
            value = f.default_factory()
        except TypeError:
            return "(computed)"
    else:
        value = f.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section defaults)"
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = str(value)
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    """The whole reference as Markdown (deterministic: sections in declaration order)."""
    from campaigns.spec import CampaignSpec

    lines = [HEADER]
    queue: list[tuple[str, type[BaseModel]]] = [("", CampaignSpec)]
    seen: set[str] = set()
    documented: dict[type[BaseModel], str] = {}
    while queue:
        prefix, model = queue.pop(0)
        if prefix in seen:
            continue
        seen.add(prefix)
        title = f"`{prefix}`" if prefix else "Top level"
        lines += ["", f"## {title}", ""]
        doc = (model.__doc__ or "").strip().split("\n\n")[0]
        if doc:
            lines += [_cell(doc), ""]
        fields = model.model_fields
        parent = documented.get(model.__mro__[1])
        if parent is not None:  # a model that extends a documented one (a list entry of `teacher`): what it adds
            lines += [f"Every field of `{parent}`, and:", ""]
            fields = {n: f for n, f in fields.items() if n not in model.__mro__[1].model_fields}
        documented[model] = prefix
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        nested = []
        for name, f in fields.items():
            key = f.alias or name
            subs = _models_in(f.annotation)
            about = f.description or (subs and (subs[0].__doc__ or "").strip().split("\n\n")[0]) or ""
            lines.append(f"| `{key}` | {_cell(_type_name(f.annotation))} | {_cell(_default(f))} | {_cell(about)} |")
            base = f"{prefix}.{key}" if prefix else key
            for i, sub in enumerate(subs):  # a field that is a model or a list of another (`teacher`): `name[]`
                nested.append((base if i == 0 else f"{base}[]", sub))
        queue.extend(nested)
    return "\n".join(lines) + "\n"


def write(path: Path | None = None) -> Path:
    path = path or reference_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    return path


def is_current(path: Path | None = None) -> bool:
    path = path or reference_path()
    return path.exists() and path.read_text() == render()
