"""The cost ledger: every dollar a campaign spent, one row per cost line, in a DuckDB file.

Tables (query them with SQL: ``campaign costs --sql "..."`` or any DuckDB client)::

    cost_lines        append-only; one row per line of spend
      line_id         primary key: a hash of (production, line index) or (run, step, attempt) for
                      interrupted spend, so recording the same thing twice is a no-op
      campaign, asset, run_id (the run that spent it), step_key, attempt
      production_id   the stage output it paid for (manifest ``production_id``); NULL if interrupted
      stage_key       content key of that stage output (its directory name)
      status          'completed' (from a committed stage manifest) or 'interrupted' (a stage stopped
                      by its budget; the work done so far is kept and resumed later)
      kind            teacher | training | evaluation (what the money bought)
      resource, quantity, unit, unit_price, usd, price_as_of, pricing_tier, catalog_version
      recorded_at     UTC
      shard           the Ray shard the line paid for (``execution.executor: ray``: a generation stage's lines are
                      per shard); NULL otherwise. Added after the first ledgers: an older file gains the column
                      (NULL in its rows) when it is next opened
      verified        false: paid, usage unknown, billed at its upper bound (requests in flight when a Ray worker
                      was lost: generation/scaleout/journal.py); true otherwise (NULL in rows of older ledgers)
      teacher         the teacher the line paid (its name, when ``teacher:`` is a list of teachers routed by
                      category: generations, scoring, replay); NULL otherwise. Added like ``shard``
    materializations  one row per (run, step, production): reused = the output came from an
                      earlier run (its cost is in that run's lines, not this one's); cost_unknown =
                      why what it cost is unknown (an unpriced teacher: no line, and never $0);
                      lines_of = the production that owns the lines this output carries (a judgement
                      of stored answers carries the answers' lines: see "Carried lines" below), NULL
                      when the output owns its lines. Added after the first ledgers, like ``shard``
    cost_reports      the cost-per-result report of each run (JSON), for dashboards

Spent now or reused? A stage output is produced once, in the run that first records its
``production_id``; every later materialization that finds it complete (a cache hit, a retried
step) adds only a ``materializations`` row with ``reused = true``, never lines. So a run's spend
is ``SUM(usd) WHERE run_id = ?`` and a result's cost is the lines of the productions it used.

Carried lines: a stage output may carry the lines of another production it was made from (the evaluation's
judgement carries its answers' lines: a changed gate threshold re-judges the same answers). Its manifest names
that production (``cost_lines_of: {"production_id": ...}``); the lines are recorded once, under that production,
by the first run that records any output carrying them. A later output carrying the same lines (a re-judgement)
is produced by its run, which spends nothing on it: the run that paid is ``lines_paid_by``, and a result's cost
still finds the lines through the ``lines_of`` of the outputs it used.

DuckDB allows one writing process per file: every call opens, works in one transaction and
closes, retrying for a while when another process holds the lock (Dagster's multiprocess
executor). Pure Python: no Dagster import.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
from tenacity import retry, retry_if_exception, stop_after_delay, wait_random_exponential

DEFAULT_NAME = "cost_ledger.duckdb"
LINE_COLUMNS = (
    "line_id",
    "campaign",
    "asset",
    "run_id",
    "step_key",
    "attempt",
    "production_id",
    "stage_key",
    "status",
    "kind",
    "resource",
    "quantity",
    "unit",
    "unit_price",
    "usd",
    "price_as_of",
    "pricing_tier",
    "catalog_version",
    "recorded_at",
    "shard",
    "verified",
    "teacher",
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS cost_lines (
    line_id VARCHAR PRIMARY KEY,
    campaign VARCHAR NOT NULL,
    asset VARCHAR NOT NULL,
    run_id VARCHAR NOT NULL,
    step_key VARCHAR,
    attempt INTEGER,
    production_id VARCHAR,
    stage_key VARCHAR,
    status VARCHAR NOT NULL,
    kind VARCHAR NOT NULL,
    resource VARCHAR NOT NULL,
    quantity DOUBLE NOT NULL,
    unit VARCHAR NOT NULL,
    unit_price DOUBLE NOT NULL,
    usd DOUBLE NOT NULL,
    price_as_of VARCHAR,
    pricing_tier VARCHAR,
    catalog_version VARCHAR,
    recorded_at TIMESTAMP NOT NULL,
    shard VARCHAR,
    verified BOOLEAN
);
CREATE TABLE IF NOT EXISTS materializations (
    run_id VARCHAR NOT NULL,
    step_key VARCHAR NOT NULL,
    campaign VARCHAR NOT NULL,
    asset VARCHAR NOT NULL,
    production_id VARCHAR NOT NULL,
    stage_key VARCHAR,
    reused BOOLEAN NOT NULL,
    production_usd DOUBLE NOT NULL,
    recorded_at TIMESTAMP NOT NULL,
    cost_unknown VARCHAR,
    lines_of VARCHAR,
    PRIMARY KEY (run_id, step_key, production_id)
);
CREATE TABLE IF NOT EXISTS cost_reports (
    campaign VARCHAR NOT NULL,
    run_id VARCHAR NOT NULL,
    recorded_at TIMESTAMP NOT NULL,
    report JSON NOT NULL,
    PRIMARY KEY (campaign, run_id)
);
CREATE OR REPLACE VIEW run_costs AS
    SELECT campaign, run_id, kind, asset, SUM(usd) AS usd, MIN(recorded_at) AS first_at, MAX(recorded_at) AS last_at
    FROM cost_lines GROUP BY ALL;
"""


# Added by every opening (a new file too), after SCHEMA: the column came with several teachers.
TEACHER_COLUMN = "ALTER TABLE cost_lines ADD COLUMN IF NOT EXISTS teacher VARCHAR"

_SCHEMA_READY: set[str] = set()


def _insert_line(con, line_id: str, who: list, line: dict, now) -> None:
    """One cost line (idempotent on its id): ``who`` is (campaign, asset, run_id, step_key, attempt,
    production_id, stage_key, status), then the priced line's own fields."""
    con.execute(
        f"INSERT INTO cost_lines ({', '.join(LINE_COLUMNS)}) VALUES ({', '.join('?' * len(LINE_COLUMNS))}) "
        "ON CONFLICT DO NOTHING",
        [
            line_id,
            *who,
            line["kind"],
            line["price_key"],
            float(line["quantity"]),
            line["unit"],
            float(line["unit_price"]),
            float(line["usd"]),
            line.get("as_of"),
            line.get("tier"),
            line.get("catalog_version"),
            now,
            line.get("shard"),
            bool(line.get("verified", True)),
            line.get("teacher"),
        ],
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


def _sha(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def production_id(manifest: dict) -> str:
    """The identity of one physical production of a stage output (set by ``StageDir.commit``);
    for manifests written without one, a hash of what identifies them."""
    pid = manifest.get("production_id")
    if pid:
        return str(pid)
    return "h-" + _sha(
        manifest.get("campaign"),
        manifest.get("stage"),
        manifest.get("key"),
        manifest.get("cost_lines", []),
        manifest.get("committed_at"),
    )


def _locked(e: BaseException) -> bool:
    return isinstance(e, duckdb.IOException) and "lock" in str(e).lower()


class Ledger:
    """A DuckDB cost ledger file (created on first write)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @retry(
        retry=retry_if_exception(_locked),
        wait=wait_random_exponential(0.05, 2),
        stop=stop_after_delay(120),
        reraise=True,
    )
    def _open(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists()
        con = duckdb.connect(str(self.path), read_only=read_only)
        if not read_only and (fresh or str(self.path) not in _SCHEMA_READY):
            # DDL costs a checkpoint: run it only when the tables are missing, once per process and file
            if con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = 'run_costs'").fetchone()[0] == 0:
                con.execute(SCHEMA)
            # ledgers written before unknown costs were kept, before lines named their Ray shard, and before
            # outputs named the production whose lines they carry, and before lines named their teacher
            con.execute("ALTER TABLE materializations ADD COLUMN IF NOT EXISTS cost_unknown VARCHAR")
            con.execute("ALTER TABLE cost_lines ADD COLUMN IF NOT EXISTS shard VARCHAR")
            con.execute("ALTER TABLE materializations ADD COLUMN IF NOT EXISTS lines_of VARCHAR")
            con.execute("ALTER TABLE cost_lines ADD COLUMN IF NOT EXISTS verified BOOLEAN")
            con.execute(TEACHER_COLUMN)
            _SCHEMA_READY.add(str(self.path))
        return con

    @contextmanager
    def connect(self, write: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection; writes run in one transaction. Reading a ledger that does not exist yet
        gives an empty in-memory one."""
        if not write and not self.path.exists():
            con = duckdb.connect(":memory:")
            con.execute(SCHEMA)
            con.execute(TEACHER_COLUMN)
        else:
            con = self._open(read_only=False)
        try:
            if write:
                con.execute("BEGIN TRANSACTION")
                try:
                    yield con
                    con.execute("COMMIT")
                except BaseException:
                    con.execute("ROLLBACK")
                    raise
            else:
                yield con
        finally:
            con.close()

    # ------------------------------------------------------------------ writing
    def record_stage(
        self, *, campaign: str, asset: str, run_id: str, step_key: str, manifest: dict, attempt: int = 0
    ) -> dict:
        """Record a materialized stage output. Its cost lines are written once, by the first run
        that records its production; later runs (cache hits) and retried steps add nothing. Lines the
        output carries from another production (``cost_lines_of``) are written once for that production,
        whichever output carries them first (see "Carried lines" above).
        Returns ``{"reused": bool, "spent_usd": float (spent by this run), "production_usd": float,
        "produced_by": the run that produced it (this run unless reused), "lines_paid_by": the run whose
        spend its lines are (this run when it spent them)}``."""
        pid = production_id(manifest)
        carried = (manifest.get("cost_lines_of") or {}).get("production_id")
        lines_pid = str(carried) if carried else pid
        lines = list(manifest.get("cost_lines") or [])
        now = _now()
        with self.connect(write=True) as con:
            owner = con.execute("SELECT run_id FROM cost_lines WHERE production_id = ? LIMIT 1", [lines_pid]).fetchone()
            seen = con.execute(
                "SELECT run_id FROM materializations WHERE production_id = ? ORDER BY recorded_at LIMIT 1", [pid]
            ).fetchone()
            if carried:  # lines with no row (none, or unpriced) are paid by the first output that carried them
                owner = (
                    owner
                    or con.execute(
                        "SELECT run_id FROM materializations WHERE lines_of = ? ORDER BY recorded_at LIMIT 1",
                        [lines_pid],
                    ).fetchone()
                )
                producer = (seen or (run_id,))[0]
            else:
                producer = (owner or seen or (run_id,))[0]
            payer = (owner or (producer,))[0]
            if producer == run_id and not owner:
                for i, line in enumerate(lines):
                    _insert_line(
                        con,
                        _sha(lines_pid, i),
                        [campaign, asset, run_id, step_key, attempt, lines_pid, manifest.get("key"), "completed"],
                        line,
                        now,
                    )
            usd = float(sum(float(x["usd"]) for x in lines))
            con.execute(
                "INSERT INTO materializations (run_id, step_key, campaign, asset, production_id, stage_key, "
                "reused, production_usd, recorded_at, cost_unknown, lines_of) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                [
                    run_id,
                    step_key,
                    campaign,
                    asset,
                    pid,
                    manifest.get("key"),
                    producer != run_id,
                    usd,
                    now,
                    # what carried lines cost is unknown where they were paid, not in a run that only carries them
                    manifest.get("cost_unknown") if payer == run_id else None,
                    lines_pid if carried else None,
                ],
            )
        return {
            "reused": producer != run_id,
            "spent_usd": usd if producer == run_id and payer == run_id else 0.0,
            "production_usd": usd,
            "produced_by": producer,
            "lines_paid_by": payer,
        }

    def record_interrupted(
        self,
        *,
        campaign: str,
        asset: str,
        run_id: str,
        step_key: str,
        attempt: int,
        stage_key: str | None,
        lines: list[dict],
        part: str | None = None,
    ) -> float:
        """Record the spend of a stage attempt that stopped before committing (budget stop).
        Idempotent per (run, step, attempt, ``part``: the piece of work within the step, e.g. a sweep's
        trial and rung, when one step runs several)."""
        now = _now()
        with self.connect(write=True) as con:
            for i, line in enumerate(lines):
                _insert_line(
                    con,
                    _sha("interrupted", run_id, step_key, attempt, i, *([part] if part else [])),
                    [campaign, asset, run_id, step_key, attempt, None, stage_key, "interrupted"],
                    line,
                    now,
                )
        return float(sum(float(x["usd"]) for x in lines))

    def record_lines(
        self,
        *,
        campaign: str,
        asset: str,
        run_id: str,
        step_key: str,
        attempt: int,
        production_id: str,
        stage_key: str | None,
        lines: list[dict],
    ) -> float:
        """Record the lines of one piece of finished work that is not a stage output of its own (one rung of one
        sweep trial: ``production_id`` names the trial and rung, e.g. ``hparam_sweep:<key>:trial-003:rung-30``).
        Idempotent per production id."""
        now = _now()
        with self.connect(write=True) as con:
            for i, line in enumerate(lines):
                _insert_line(
                    con,
                    _sha(production_id, i),
                    [campaign, asset, run_id, step_key, attempt, production_id, stage_key, "completed"],
                    line,
                    now,
                )
        return float(sum(float(x["usd"]) for x in lines))

    def record_report(self, campaign: str, run_id: str, report: dict) -> None:
        """Store (or replace) the cost report of a run; reports are derived, lines are not."""
        with self.connect(write=True) as con:
            con.execute(
                "INSERT OR REPLACE INTO cost_reports VALUES (?, ?, ?, ?)",
                [campaign, run_id, _now(), json.dumps(report, default=str)],
            )

    # ------------------------------------------------------------------ reading
    def query(self, sql: str, params: list | None = None) -> list[dict]:
        with self.connect() as con:
            cur = con.execute(sql, params or [])
            cols = [d[0] for d in cur.description] if cur.description else []
            return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]

    def user_query(self, sql: str) -> list[dict]:
        """A query of the user's own (``campaign costs --sql``) over the ledger's tables, read-only."""
        return self.query(sql)

    def stage_spent(self, campaign: str, asset: str, stage_key: str, status: str | None = None) -> float:
        """Dollars recorded for one stage output (``asset`` at ``stage_key``), every run; ``status``: only
        ``completed`` or ``interrupted`` lines."""
        sql = "SELECT COALESCE(SUM(usd), 0) AS usd FROM cost_lines WHERE campaign = ? AND asset = ? AND stage_key = ?"
        params = [campaign, asset, stage_key]
        if status is not None:
            sql, params = sql + " AND status = ?", params + [status]
        return float(self.query(sql, params)[0]["usd"])

    def production_spend(self, campaign: str, asset: str, stage_key: str) -> list[dict]:
        """``production_id`` and ``usd`` of every line of one stage output (e.g. a sweep's rungs), every run."""
        return self.query(
            "SELECT production_id, usd FROM cost_lines WHERE campaign = ? AND asset = ? AND stage_key = ?",
            [campaign, asset, stage_key],
        )

    def assets_materialized(self, campaign: str, run_id: str, produced_only: bool = False) -> set[str]:
        """The assets ``run_id`` materialized (``produced_only``: produced, not reused from the cache)."""
        sql = "SELECT DISTINCT asset FROM materializations WHERE campaign = ? AND run_id = ?"
        return {r["asset"] for r in self.query(sql + (" AND NOT reused" if produced_only else ""), [campaign, run_id])}

    def spent_by_asset(self, campaign: str, run_id: str) -> dict[str, float]:
        """Asset -> dollars recorded in ``run_id``."""
        return {
            r["asset"]: r["usd"]
            for r in self.query(
                "SELECT asset, SUM(usd) AS usd FROM cost_lines WHERE campaign = ? AND run_id = ? GROUP BY asset "
                "ORDER BY asset",
                [campaign, run_id],
            )
        }

    def run_outputs(self, campaign: str, run_id: str) -> list[dict]:
        """``asset`` and ``stage_key`` (its latest) of every stage output ``run_id`` materialized (own or reused)."""
        return self.query(
            "SELECT asset, arg_max(stage_key, recorded_at) AS stage_key FROM materializations "
            "WHERE campaign = ? AND run_id = ? GROUP BY asset",
            [campaign, run_id],
        )

    def spent(self, campaign: str, asset: str | None = None, run_id: str | None = None) -> float:
        """Dollars recorded for a campaign (optionally one asset and/or one run), completed + interrupted."""
        sql, params = "SELECT COALESCE(SUM(usd), 0) AS usd FROM cost_lines WHERE campaign = ?", [campaign]
        if asset is not None:
            sql, params = sql + " AND asset = ?", params + [asset]
        if run_id is not None:
            sql, params = sql + " AND run_id = ?", params + [run_id]
        return float(self.query(sql, params)[0]["usd"])

    def teacher_spent(self, campaign: str, teacher: str, asset: str | None = None, run_id: str | None = None) -> float:
        """Dollars recorded for one teacher of a campaign with several (its tagged lines; optionally one asset
        and/or one run), completed + interrupted."""
        sql = "SELECT COALESCE(SUM(usd), 0) AS usd FROM cost_lines WHERE campaign = ? AND teacher = ?"
        params: list = [campaign, teacher]
        if asset is not None:
            sql, params = sql + " AND asset = ?", params + [asset]
        if run_id is not None:
            sql, params = sql + " AND run_id = ?", params + [run_id]
        return float(self.query(sql, params)[0]["usd"])

    def unknown(self, campaign: str, run_id: str | None = None) -> dict[str, str]:
        """Asset -> why its cost is unknown, for the stage outputs produced (not reused) in the campaign (or in
        ``run_id``) at a price nobody told us (an unpriced teacher): spend that includes them is unknown."""
        sql = (
            "SELECT asset, min(cost_unknown) AS why FROM materializations WHERE campaign = ? AND NOT reused "
            "AND cost_unknown IS NOT NULL"
        )
        params: list = [campaign]
        if run_id is not None:
            sql, params = sql + " AND run_id = ?", params + [run_id]
        return {r["asset"]: r["why"] for r in self.query(sql + " GROUP BY asset ORDER BY asset", params)}

    def lines(self, campaign: str | None = None, run_id: str | None = None) -> list[dict]:
        where, params = [], []
        if campaign is not None:
            where, params = where + ["campaign = ?"], params + [campaign]
        if run_id is not None:
            where, params = where + ["run_id = ?"], params + [run_id]
        sql = (
            "SELECT * FROM cost_lines"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + " ORDER BY recorded_at, line_id"
        )
        return self.query(sql, params)

    def lineage_lines(self, campaign: str, outputs: dict[str, str]) -> list[dict]:
        """Every line (completed and interrupted, any run) paid for the stage outputs
        ``{asset: stage_key}`` a result was built from, and the lines they carry from other productions
        (a re-judged evaluation's answers), each once."""
        if not outputs:
            return []
        cond = " OR ".join("(asset = ? AND stage_key = ?)" for _ in outputs)
        pairs = [x for pair in outputs.items() for x in pair]
        return self.query(
            f"SELECT * FROM cost_lines WHERE campaign = ? AND (({cond}) OR production_id IN ("
            f"SELECT lines_of FROM materializations WHERE campaign = ? AND lines_of IS NOT NULL AND ({cond}))) "
            "ORDER BY recorded_at, line_id",
            [campaign, *pairs, campaign, *pairs],
        )

    def carried_from(self, campaign: str, run_id: str) -> dict[str, str]:
        """Asset -> the run that paid for the lines an output of ``run_id`` carries (a re-judgement of answers an
        earlier run paid for: this run produced the output and spent nothing on it)."""
        rows = self.query(
            "SELECT m.asset, min(p.run_id) AS payer FROM materializations m JOIN ("
            "SELECT lines_of, arg_min(run_id, recorded_at) AS run_id FROM materializations WHERE campaign = ? "
            "AND lines_of IS NOT NULL GROUP BY lines_of) p ON p.lines_of = m.lines_of "
            "WHERE m.campaign = ? AND m.run_id = ? AND NOT m.reused AND p.run_id <> m.run_id GROUP BY m.asset",
            [campaign, campaign, run_id],
        )
        return {r["asset"]: r["payer"] for r in rows}

    def runs(self, campaign: str) -> list[dict]:
        """Per run: first/last record time, total spend, completed spend by kind and budget-stopped
        (interrupted) spend, for every run with spend or materializations; ``unknown``: what in the run
        was produced at an unknown price ("asset: why"; None when every cost is known: the sums then
        are the run's spend, else only its priced part)."""
        return self.query(
            """
            WITH r AS (
                SELECT run_id, MIN(recorded_at) AS started_at, MAX(recorded_at) AS ended_at
                FROM (SELECT run_id, recorded_at FROM materializations WHERE campaign = $1
                      UNION ALL SELECT run_id, recorded_at FROM cost_lines WHERE campaign = $1) GROUP BY run_id),
            u AS (
                SELECT run_id, string_agg(DISTINCT asset || ': ' || cost_unknown, '; ') AS unknown
                FROM materializations WHERE campaign = $1 AND NOT reused AND cost_unknown IS NOT NULL GROUP BY run_id)
            SELECT r.run_id, r.started_at, r.ended_at, u.unknown,
                   COALESCE(SUM(l.usd), 0) AS usd,
                   COALESCE(SUM(l.usd) FILTER (WHERE l.kind = 'teacher' AND l.status = 'completed'), 0) AS teacher_usd,
                   COALESCE(SUM(l.usd) FILTER (WHERE l.kind = 'training' AND l.status = 'completed'), 0)
                       AS training_usd,
                   COALESCE(SUM(l.usd) FILTER (WHERE l.kind = 'evaluation' AND l.status = 'completed'), 0)
                       AS evaluation_usd,
                   COALESCE(SUM(l.usd) FILTER (WHERE l.status = 'interrupted'), 0) AS interrupted_usd
            FROM r LEFT JOIN cost_lines l ON l.run_id = r.run_id AND l.campaign = $1 LEFT JOIN u ON u.run_id = r.run_id
            GROUP BY ALL ORDER BY r.started_at
            """,
            [campaign],
        )

    def reports(self, campaign: str) -> list[dict]:
        rows = self.query(
            "SELECT run_id, recorded_at, report FROM cost_reports WHERE campaign = ? ORDER BY recorded_at", [campaign]
        )
        return [{**r, "report": json.loads(r["report"]) if isinstance(r["report"], str) else r["report"]} for r in rows]

    def reused_from(self, campaign: str, run_id: str) -> dict[str, str]:
        """Asset -> the run that produced the output ``run_id`` reused (a cache hit: it ran nothing for it)."""
        rows = self.query(
            "SELECT m.asset, min(p.run_id) AS producer FROM materializations m JOIN materializations p "
            "ON p.production_id = m.production_id AND NOT p.reused WHERE m.campaign = ? AND m.run_id = ? AND m.reused "
            "GROUP BY m.asset",
            [campaign, run_id],
        )
        return {r["asset"]: r["producer"] for r in rows}

    def stage_outcomes(self) -> dict[tuple[str, str, str], dict]:
        """``(campaign, run_id, asset)`` -> ``{"produced": bool, "reused_from": run or None}`` for every stage
        output every run materialized: produced by that run, or reused from the run that produced it."""
        rows = self.query(
            "SELECT m.campaign, m.run_id, m.asset, bool_or(NOT m.reused) AS produced, min(p.run_id) AS producer "
            "FROM materializations m LEFT JOIN materializations p ON m.reused AND p.production_id = m.production_id "
            "AND NOT p.reused GROUP BY ALL"
        )
        return {
            (r["campaign"], r["run_id"], r["asset"]): {
                "produced": bool(r["produced"]),
                "reused_from": None if r["produced"] else r["producer"],
            }
            for r in rows
        }

    def runs_reusing_everything(self) -> set[str]:
        """The runs whose every materialization was a cache hit (they produced nothing)."""
        return {
            r["run_id"]
            for r in self.query("SELECT run_id FROM materializations GROUP BY run_id HAVING bool_and(reused)")
        }

    def campaigns(self) -> list[str]:
        return [
            r["campaign"]
            for r in self.query(
                "SELECT DISTINCT campaign FROM (SELECT campaign FROM cost_lines UNION SELECT campaign FROM "
                "materializations) ORDER BY campaign"
            )
        ]
