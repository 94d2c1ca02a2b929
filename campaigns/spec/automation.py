"""The ``automation:`` section: the new-data, model-change and drift sensors."""

from __future__ import annotations

from pydantic import Field

from campaigns.spec.common import Cron, _Strict


class NewDataSpec(_Strict):
    """New-data sensor ``<campaign>_new_data``: watches ``data.source`` (local glob or ``s3://`` prefix).

    Files are identified by content hash: a touched, renamed or re-uploaded file with the same
    content is not new data. The first evaluation records the files already there as the
    baseline; files that appear later are new data. A run (``prompts`` and everything
    downstream) is requested once the new rows pass every threshold set here.
    """

    enabled: bool = Field(False, description="Start the sensor switched on (it can always be toggled in the UI).")
    min_new_rows: int = Field(1, ge=1, description="Request a run only once at least this many new rows are pending.")
    min_new_fraction: float | None = Field(
        None,
        gt=0.0,
        description=(
            "And only once new rows / rows already used reach this fraction (e.g. 0.1); unset: no fraction rule."
        ),
    )
    interval_s: int = Field(60, ge=5, le=86_400, description="Seconds between two evaluations of the sensor.")


class ModelChangeSpec(_Strict):
    """Model-change sensor ``<campaign>_model_change``.

    Every stage carries a code version derived from its slice of the spec (teacher identity,
    including a path model's weights hash, for generations; student base identity for
    tokenizing; training settings for the adapter; ...). A stage whose latest materialization
    has another code version, or was made from an older version of an upstream asset, is stale;
    the sensor re-materializes the stale stages and everything downstream of them in one run,
    nothing upstream.
    """

    enabled: bool = Field(False, description="Start the sensor switched on.")
    interval_s: int = Field(60, ge=5, le=86_400, description="Seconds between two evaluations of the sensor.")


class DriftSpec(_Strict):
    """Drift schedule ``<campaign>_drift``: re-evaluates the promoted model on the freshest held-out data.

    A retraining run (``prompts`` and everything downstream, on the freshest data) is requested by
    the ``<campaign>_drift_retrain`` sensor when the promoted model scores below
    ``evaluation.gate.min_score`` or more than ``max_drop`` below its own promotion-time score.
    """

    enabled: bool = Field(False, description="Start the drift schedule and its retraining sensor switched on.")
    cron: Cron = Field("0 4 * * *", description="Cron expression of the re-evaluation, e.g. '0 4 * * *'.")
    timezone: str = Field("UTC", description="IANA timezone of the cron expression.")
    max_drop: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Allowed drop below the promotion-time score; unset: `evaluation.gate.max_regression_vs_base`.",
    )


class AutomationSpec(_Strict):
    """What re-runs the campaign by itself. Every sensor exists (stopped) even when not enabled here."""

    new_data: NewDataSpec = Field(default_factory=NewDataSpec, description="New prompt files trigger a run.")
    model_change: ModelChangeSpec = Field(
        default_factory=ModelChangeSpec,
        description="A new teacher, student base or training setting re-runs what it affects.",
    )
    drift: DriftSpec = Field(default_factory=DriftSpec, description="Scheduled re-evaluation of the promoted model.")
