"""The new-data sensor's memory (its cursor) and its decision, as plain functions.

The cursor is JSON kept by Dagster in the instance's storage, so it survives restarts of the
daemon and of the UI. It records every content hash ever seen with its status:

- ``baseline``: already there when the sensor first looked (never a trigger);
- ``consumed``: new data that was part of a requested run;
- ``pending``: new data still below the threshold (it accumulates with later drops).

A file whose content hash is known (touched, renamed, re-uploaded, copied) is not new data. A
rewritten file (same name, new content) counts only the rows it gained.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from campaign_orchestrator.content import short, value_sha256
from campaign_orchestrator.triggers.sources import SourceFile

CURSOR_VERSION = 1


@dataclass
class NewDataState:
    initialized: bool = False
    # sha256 -> {"name", "rows", "new_rows", "status", "seen_at"}
    seen: dict[str, dict] = field(default_factory=dict)
    # uri -> [stamp, sha256, rows]: skip re-hashing unchanged files
    stat_cache: dict[str, list[str]] = field(default_factory=dict)
    # file name -> sha256 of its latest content (to count the rows a rewritten file gained)
    latest_by_name: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_cursor(cls, cursor: str | None) -> NewDataState:
        if not cursor:
            return cls()
        try:
            raw = json.loads(cursor)
        except json.JSONDecodeError:
            raise ValueError(
                f"new-data sensor cursor is not JSON: {cursor[:80]!r}; reset the cursor in the UI"
            ) from None
        if raw.get("v") != CURSOR_VERSION:
            raise ValueError(
                f"new-data sensor cursor has version {raw.get('v')!r}, expected {CURSOR_VERSION}; reset it"
            )
        return cls(True, raw["seen"], raw.get("stat", {}), raw.get("names", {}))

    def to_cursor(self) -> str:
        return json.dumps(
            {"v": CURSOR_VERSION, "seen": self.seen, "stat": self.stat_cache, "names": self.latest_by_name},
            sort_keys=True,
            separators=(",", ":"),
        )

    def rows(self, *statuses: str) -> int:
        return sum(int(v["new_rows"]) for v in self.seen.values() if v["status"] in statuses)

    def pending(self) -> dict[str, dict]:
        return {h: v for h, v in self.seen.items() if v["status"] == "pending"}


@dataclass(frozen=True)
class Threshold:
    min_new_rows: int = 1
    min_new_fraction: float | None = None

    def describe(self) -> str:
        parts = [f">= {self.min_new_rows} new rows"]
        if self.min_new_fraction is not None:
            parts.append(f">= {self.min_new_fraction:.1%} of the rows already used")
        return " and ".join(parts)


@dataclass(frozen=True)
class Decision:
    request: bool
    reason: str
    run_key: str | None = None
    new_files: tuple[str, ...] = ()
    new_rows: int = 0
    known_rows: int = 0


def observe(state: NewDataState, files: list[SourceFile], threshold: Threshold, now: float | None = None) -> Decision:
    """Update ``state`` with the current listing and decide whether to request a run.

    On a request the pending hashes become ``consumed`` (so they never trigger again); the run
    key is derived from them, so even a lost cursor update cannot start the same run twice.
    """
    now = time.time() if now is None else now
    state.stat_cache = {f.uri: [f.stamp, f.sha256, str(f.rows)] for f in files}
    first = not state.initialized
    fresh: list[SourceFile] = []
    for f in files:
        if f.sha256 in state.seen:
            state.latest_by_name.setdefault(f.name, f.sha256)
            continue
        previous = state.seen.get(state.latest_by_name.get(f.name, ""))
        gained = f.rows if previous is None else max(0, f.rows - int(previous["rows"]))
        state.seen[f.sha256] = {
            "name": f.name,
            "rows": f.rows,
            "new_rows": f.rows if first else gained,
            "status": "baseline" if first else "pending",
            "seen_at": round(now, 3),
        }
        state.latest_by_name[f.name] = f.sha256
        fresh.append(f)
    state.initialized = True
    if first:
        return Decision(
            False,
            f"recorded the baseline: {len(files)} file(s), {sum(f.rows for f in files)} rows already "
            f"there; files that appear from now on are new data",
            known_rows=state.rows("baseline"),
        )
    pending = state.pending()
    new_rows = sum(int(v["new_rows"]) for v in pending.values())
    known = state.rows("baseline", "consumed")
    names = tuple(sorted(v["name"] for v in pending.values()))
    if not pending:
        return Decision(False, f"no new data ({len(files)} file(s) known by content hash)", known_rows=known)
    frac = new_rows / known if known else float("inf")
    ok = new_rows >= threshold.min_new_rows and (
        threshold.min_new_fraction is None or frac >= threshold.min_new_fraction
    )
    summary = (
        f"{len(pending)} new file(s) ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}), "
        f"{new_rows} new rows (+{frac:.1%} over {known})"
    )
    if not ok:
        return Decision(
            False,
            f"new data below the threshold: {summary}; waiting for {threshold.describe()}",
            new_files=names,
            new_rows=new_rows,
            known_rows=known,
        )
    for v in pending.values():
        v["status"] = "consumed"
    return Decision(
        True,
        f"new data: {summary}",
        run_key=f"new-data-{short(value_sha256(sorted(pending)), 20)}",
        new_files=names,
        new_rows=new_rows,
        known_rows=known,
    )
