"""Which campaign stages are stale, and what a model-change run must re-materialize.

A stage is stale when its latest materialization was made with another code version than
the one the spec gives it now (a new teacher, student base, training setting, ...; see
``assets/versions.py``), or from another data version of one of its upstream assets than the
latest one (e.g. a rebuilt demo model). A never-materialized stage is not stale (it is
missing: nothing to redo). The run re-materializes every stale stage and everything
downstream of it, and nothing upstream. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from campaign_orchestrator.content import short, value_sha256


@dataclass(frozen=True)
class Recorded:
    """What a stage's latest materialization recorded (Dagster's data provenance tags)."""

    code_version: str | None
    input_data_versions: dict[str, str] = field(default_factory=dict)  # upstream key -> data version


@dataclass(frozen=True)
class StalePlan:
    stale: dict[str, str]  # stage key -> why
    selection: list[str]  # stale stages and everything downstream, in graph order

    @property
    def run_key(self) -> str:
        return f"model-change-{short(value_sha256(sorted(self.stale.items())), 20)}"

    def reason(self, max_len: int = 900) -> str:
        text = "; ".join(f"{k}: {why}" for k, why in self.stale.items())
        return text if len(text) <= max_len else text[: max_len - 3] + "..."


def plan(
    order: list[str],
    parents: dict[str, list[str]],
    current_code_versions: dict[str, str],
    recorded: dict[str, Recorded | None],
    latest_data_versions: dict[str, str | None],
    explain: dict[str, str] | None = None,
) -> StalePlan:
    """``order``: the stage keys in topological order; ``parents``: their upstream keys (any asset);
    ``recorded``: per stage, its latest materialization's provenance (None: never materialized);
    ``latest_data_versions``: current data version of every upstream key (None: never made)."""
    explain = explain or {}
    stale: dict[str, str] = {}
    for k in order:
        rec = recorded.get(k)
        if rec is None:
            continue
        now = current_code_versions.get(k)
        if rec.code_version is not None and now is not None and rec.code_version != now:
            what = f" ({explain[k]})" if k in explain else ""
            stale[k] = f"code version {rec.code_version} -> {now}{what}"
            continue
        for p in parents.get(k, []):
            then, latest = rec.input_data_versions.get(p), latest_data_versions.get(p)
            if then is not None and latest is not None and then != latest:
                stale[k] = f"upstream {p} changed (data version {then[:12]} -> {latest[:12]})"
                break
    children: dict[str, list[str]] = {k: [] for k in order}
    for k in order:
        for p in parents.get(k, []):
            if p in children:
                children[p].append(k)
    selected, todo = set(), list(stale)
    while todo:
        k = todo.pop()
        if k not in selected:
            selected.add(k)
            todo += children[k]
    return StalePlan(stale, [k for k in order if k in selected])
