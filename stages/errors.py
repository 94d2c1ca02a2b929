"""The exceptions a stage raises for its adapter to translate (the Dagster assets turn them into ``Failure``s with
the same description and metadata; plain callers see them as they are)."""

from __future__ import annotations

from typing import Any


class StageError(Exception):
    """A stage refused or failed with a message for people; ``metadata`` says more, ``retry`` False when a retry
    cannot help (a wrong setting, a budget)."""

    def __init__(self, message: str, *, metadata: dict[str, Any] | None = None, retry: bool = True):
        super().__init__(message)
        self.metadata = dict(metadata or {})
        self.retry = retry


class BudgetStopped(StageError):
    """A budget stop (a ``campaign_orchestrator.costs.budget.BudgetExceeded``, kept as ``budget``): never retried,
    retrying cannot make money appear. The budget guards of the stages raise it (``stages.pricing``)."""

    def __init__(self, exc):
        super().__init__(str(exc), metadata=exc.metadata(), retry=False)
        self.budget = exc


class TeacherStopped(BudgetStopped):
    """One teacher of several stopped by its ``budget_share`` (``teacher``: its name): the teacher stage stops asking
    it and goes on with the others (``stages/teacher_generations.py``); anywhere else it is a budget stop."""

    def __init__(self, exc, teacher: str):
        super().__init__(exc)
        self.teacher = teacher
