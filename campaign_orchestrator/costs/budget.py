"""Budgets that stop spending: checked before a stage from the planner's estimate and during it
from the spend accrued so far.

A stage that spends money takes a :class:`BudgetGuard` (from ``PricingResource.budget_guard``)
before it starts and lets it see its progress::

    guard = pricing.budget_guard(context, spec, sd)      # refuses to start if the estimate won't fit
    progress = guard.watch(progress)                     # each tick: would the next chunk exceed?

When the budget would be exceeded the guard records what the stopped attempt spent in the ledger
(status ``interrupted``) and raises :class:`BudgetExceeded`, whose message says what was spent
and what remains. The stage keeps what it finished (a resumable stage writes its work as it
goes); raising the budget and materializing again resumes it.

Limits: the campaign's ``cost.budget_usd`` and the stage's ``cost.stage_budgets_usd`` entry, each
against the ledger's spend of the campaign (all runs, or this run with ``budget_scope: run``).
Pure Python: no Dagster import.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from campaign_orchestrator.costs.ledger import Ledger


class BudgetExceeded(RuntimeError):
    """The stage stopped (or did not start) because a budget would be exceeded."""

    def __init__(self, message: str, *, scope: str, budget_usd: float, spent_usd: float, needed_usd: float):
        super().__init__(message)
        self.scope, self.budget_usd, self.spent_usd, self.needed_usd = scope, budget_usd, spent_usd, needed_usd

    @property
    def remaining_usd(self) -> float:
        return max(0.0, self.budget_usd - self.spent_usd)

    def metadata(self) -> dict[str, Any]:
        return {"budget_scope": self.scope, "budget_usd": self.budget_usd, "spent_usd": self.spent_usd,
                "remaining_usd": self.remaining_usd, "needed_usd": self.needed_usd}


@dataclass(frozen=True)
class Limit:
    scope: str  # "campaign demo" or "stage teacher_generations"
    budget_usd: float
    spent_before_usd: float  # recorded in the ledger before this stage attempt started


class BudgetGuard:
    """Watches one attempt of one stage. ``line_fn(seconds, items_done)`` gives the cost lines of
    the work done so far (time on hardware, or tokens for an API); with no limits the guard only
    keeps time."""

    def __init__(self, *, ledger: Ledger, campaign: str, stage: str, run_id: str, step_key: str, attempt: int,
                 stage_key: str | None, limits: list[Limit], line_fn: Callable[[float, int], list[dict]],
                 log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic,
                 on_exceeded: Callable[[BudgetExceeded], BaseException] = lambda e: e):
        self.ledger, self.campaign, self.stage = ledger, campaign, stage
        self.run_id, self.step_key, self.attempt, self.stage_key = run_id, step_key, attempt, stage_key
        self.limits, self.line_fn, self.log, self.clock = limits, line_fn, log, clock
        self.on_exceeded = on_exceeded  # e.g. turn the error into a framework's non-retryable failure
        self.t0 = clock()
        self.items = 0
        self._last_usd = 0.0
        self.stopped = False

    # ------------------------------------------------------------------ before
    def check_estimate(self, estimate_usd: float, already_spent_on_it_usd: float = 0.0) -> None:
        """Refuse to start when the planner's estimate (less what earlier interrupted attempts of
        the same output already spent) does not fit in what remains."""
        need = max(0.0, estimate_usd - already_spent_on_it_usd)
        for lim in self.limits:
            if lim.spent_before_usd + need > lim.budget_usd:
                raise self.on_exceeded(BudgetExceeded(
                    f"budget: not starting {self.stage}: {lim.scope} has spent ${lim.spent_before_usd:.6f} of its "
                    f"${lim.budget_usd:.6f} budget (${max(0.0, lim.budget_usd - lim.spent_before_usd):.6f} remains) and "
                    f"the planner estimates ${need:.6f} for this stage. Raise the budget (cost.budget_usd / "
                    f"cost.stage_budgets_usd) or set cost.check_estimates: false, then materialize again.",
                    scope=lim.scope, budget_usd=lim.budget_usd, spent_usd=lim.spent_before_usd, needed_usd=need))

    # ------------------------------------------------------------------ during
    def accrued_lines(self) -> list[dict]:
        return self.line_fn(self.clock() - self.t0, self.items)

    def accrued_usd(self) -> float:
        return float(sum(x["usd"] for x in self.accrued_lines()))

    def check(self, items_done: int | None = None, final: bool = False) -> None:
        """Stop when the spend so far plus one more chunk like the last would exceed a limit
        (``final``: the work is complete, so only what was spent counts)."""
        if items_done is not None:
            self.items = items_done
        if not self.limits or self.stopped:
            return
        lines = self.accrued_lines()
        now = float(sum(x["usd"] for x in lines))
        step = 0.0 if final else max(0.0, now - self._last_usd)
        self._last_usd = now
        for lim in self.limits:
            if lim.spent_before_usd + now + step > lim.budget_usd:
                self.stopped = True
                self.ledger.record_interrupted(campaign=self.campaign, asset=self.stage, run_id=self.run_id,
                                               step_key=self.step_key, attempt=self.attempt, stage_key=self.stage_key,
                                               lines=lines)
                spent = lim.spent_before_usd + now
                self.log(f"budget stop in {self.stage}: recorded ${now:.6f} of interrupted spend")
                raise self.on_exceeded(BudgetExceeded(
                    f"budget: stopped {self.stage} mid-way: {lim.scope} has spent ${spent:.6f} of its "
                    f"${lim.budget_usd:.6f} budget (this attempt ${now:.6f}, recorded in the ledger as interrupted); "
                    f"${max(0.0, lim.budget_usd - spent):.6f} remains and the next chunk would cost about ${step:.6f}. "
                    f"Work finished so far is kept: raise the budget and materialize again to resume.",
                    scope=lim.scope, budget_usd=lim.budget_usd, spent_usd=spent, needed_usd=step))

    def watch(self, progress: Callable[[int], None] | None = None) -> _Watched:
        """Wrap a progress callback ``progress(n_new_items)``: each call also checks the budget."""
        return _Watched(self, progress)


class _Watched:
    def __init__(self, guard: BudgetGuard, inner: Callable[[int], None] | None):
        self._guard, self._inner = guard, inner
        self.done = 0

    def __call__(self, n: int) -> None:
        if self._inner is not None:
            self._inner(n)
        self.done += n
        total = getattr(self._inner, "total", None)
        self._guard.check(self.done, final=total is not None and self.done >= total)

    def __getattr__(self, name: str) -> Any:  # close(), total, ... of the wrapped progress
        return getattr(self._inner, name)


def limits_for(ledger: Ledger, campaign: str, stage: str, budget_usd: float | None,
               stage_budget_usd: float | None, run_id: str | None = None) -> list[Limit]:
    """The limits that apply to ``stage``, with the ledger's spend so far (``run_id``: this run only)."""
    out = []
    if budget_usd is not None:
        out.append(Limit(f"campaign {campaign}", budget_usd, ledger.spent(campaign, run_id=run_id)))
    if stage_budget_usd is not None:
        out.append(Limit(f"stage {stage}", stage_budget_usd, ledger.spent(campaign, asset=stage, run_id=run_id)))
    return out
