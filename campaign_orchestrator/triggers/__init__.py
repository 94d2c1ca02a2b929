"""Plain logic behind the campaign sensors and schedules (no Dagster import here).

``sources``: list a prompt source (local glob or ``s3://`` prefix) as files identified by content
hash. ``newdata``: the new-data sensor's cursor and its run/no-run decision. ``staleness``:
which stages a model or settings change made stale, and what to re-run. The drift decision for a
promoted model re-evaluated on fresh held-out data is scoring, so it lives in :mod:`evaluation.drift`.
"""
