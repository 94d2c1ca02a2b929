"""The ``tracking:`` section: experiment tracking where teams already look (MLflow), off by default."""

from __future__ import annotations

from pydantic import Field

from campaigns.spec.common import _Strict


class MlflowSpec(_Strict):
    """Every training run and every sweep trial is an MLflow run: parameters, per-step metrics, cost and verdict."""

    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI: a server (http://mlflow:5000), sqlite:///path.db or a file store "
        "path; default a SQLite store under the artifact root (<root>/mlflow/mlflow.db).",
    )
    experiment: str | None = Field(None, description="Experiment name; default the campaign's name.")


class TrackingSpec(_Strict):
    mlflow: MlflowSpec | None = Field(None, description="Log to MLflow (unset: no tracking).")
