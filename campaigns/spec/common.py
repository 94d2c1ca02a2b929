"""Shared by every section of the campaign spec: the strict base model, slugs, ``s3://`` URIs, cron expressions."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from campaigns.object_store import parse_s3_url

SLUG = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _s3_uri(v: str | None) -> str | None:
    if v is not None:
        parse_s3_url(v)  # raises ValueError, which pydantic reports against the field
    return v


S3Uri = Annotated[str | None, AfterValidator(_s3_uri)]


def _cron(v: str) -> str:
    if len(v.split()) != 5:
        raise ValueError(f"a cron expression has 5 fields (minute hour day month weekday), got {v!r}")
    return v


Cron = Annotated[str, AfterValidator(_cron)]


class FieldValueError(ValueError):
    """A campaign-wide rule broken at one field: a model validator raises it with the field's location
    (``("teacher", 1, "budget_share")``), so ``campaign validate`` names that field and its line rather than the top
    level (``campaigns.loader``)."""

    def __init__(self, loc: tuple, message: str):
        super().__init__(message)
        self.loc = tuple(loc)
