"""Budgets that stop spending: checked before a stage from the planner's estimate and during it
from the spend accrued so far.

A stage that spends money takes a :class:`BudgetGuard` (from ``stages.pricing.Pricing.guard``)
before it starts and lets it see its progress::

    guard = pricing.guard(context, spec, sd)             # refuses to start if the estimate won't fit
    progress = guard.watch(progress)                     # each tick: would the next chunk exceed?

A stage whose cost is metered rather than timed (the teacher: tokens from each response, or the
generation seconds of a local model) reports what each newly paid piece of work used instead::

    guard.check_planned(share)                           # the planner's estimate x the share still to pay for
    guard.charge(prompt_tokens=..., completion_tokens=..., seconds=...)   # never for a cache hit

When the budget would be exceeded the guard records what the stopped attempt spent in the ledger
(status ``interrupted``) and raises :class:`BudgetExceeded`, whose message says what was spent
and what remains. The stage keeps what it finished (a resumable stage writes its work as it
goes); raising the budget and materializing again resumes it.

Limits: the campaign's ``cost.budget_usd`` and the stage's ``cost.stage_budgets_usd`` entry, each
against the ledger's spend of the campaign (all runs, or this run with ``budget_scope: run``).
Pure Python: no Dagster import.
"""

from __future__ import annotations

import threading
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
        return {
            "budget_scope": self.scope,
            "budget_usd": self.budget_usd,
            "spent_usd": self.spent_usd,
            "remaining_usd": self.remaining_usd,
            "needed_usd": self.needed_usd,
        }


@dataclass(frozen=True)
class Limit:
    scope: str  # "campaign demo" or "stage teacher_generations"
    budget_usd: float
    spent_before_usd: float  # recorded in the ledger before this stage attempt started
    # spend outside this attempt that moves while it runs (read at every check instead of spent_before_usd): e.g. a
    # sweep rung's ledger spend so far plus what the rungs running next to it have accrued
    spent_now: Callable[[], float] | None = None

    def spent_elsewhere(self) -> float:
        return float(self.spent_now()) if self.spent_now is not None else self.spent_before_usd


@dataclass
class Usage:
    """What the newly paid work of a metered stage used so far (cache hits are not in it)."""

    items: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


class BudgetGuard:
    """Watches one attempt of one stage. ``line_fn(seconds, items_done)`` gives the cost lines of
    the work done so far (time on hardware since the guard was made); a metered stage passes
    ``metered(usage)`` instead, the lines of the :class:`Usage` its paid work reported through
    :meth:`charge`; a timed stage that also pays for reported usage (on-policy training with an API teacher:
    its prefills, charged per round) passes both, and accrues their sum. With no limits the guard only keeps
    count. ``part`` names the piece of work within the step (a sweep's trial and rung) when one step runs
    several guarded attempts."""

    def __init__(
        self,
        *,
        ledger: Ledger,
        campaign: str,
        stage: str,
        run_id: str,
        step_key: str,
        attempt: int,
        stage_key: str | None,
        limits: list[Limit],
        line_fn: Callable[[float, int], list[dict]] | None = None,
        metered: Callable[[Usage], list[dict]] | None = None,
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
        on_exceeded: Callable[[BudgetExceeded], BaseException] = lambda e: e,
        part: str | None = None,
    ):
        if line_fn is None and metered is None:
            raise ValueError(
                "BudgetGuard needs line_fn (timed work), metered (reported usage), or both (timed work "
                "that also pays for reported usage: on-policy training's teacher prefills)"
            )
        self.ledger, self.campaign, self.stage = ledger, campaign, stage
        self.run_id, self.step_key, self.attempt, self.stage_key = run_id, step_key, attempt, stage_key
        self.limits, self.line_fn, self.metered, self.log, self.clock = limits, line_fn, metered, log, clock
        self.on_exceeded = on_exceeded  # e.g. turn the error into a framework's non-retryable failure
        self.part = part
        self.t0 = clock()
        self.items = 0
        self.usage = Usage()
        self.planned_usd: float | None = None  # a planner estimate checked later, by check_planned
        self._lock = threading.Lock()
        self._last_usd = 0.0
        self._step_usd = 0.0  # what the last chunk that cost anything cost
        self.stopped = False
        self.interrupted_usd = 0.0  # what the stop recorded in the ledger

    # ------------------------------------------------------------------ before
    def check_estimate(self, estimate_usd: float, already_spent_on_it_usd: float = 0.0) -> None:
        """Refuse to start when the planner's estimate (less what earlier interrupted attempts of
        the same output already spent) does not fit in what remains."""
        need = max(0.0, estimate_usd - already_spent_on_it_usd)
        for lim in self.limits:
            before = lim.spent_elsewhere()
            if before + need > lim.budget_usd:
                raise self.on_exceeded(
                    BudgetExceeded(
                        f"budget: not starting {self.stage}: {lim.scope} has spent ${before:.6f} of its "
                        f"${lim.budget_usd:.6f} budget (${max(0.0, lim.budget_usd - before):.6f} remains) and "
                        f"the planner estimates ${need:.6f} for this stage. Raise the budget (cost.budget_usd / "
                        f"cost.stage_budgets_usd) or set cost.check_estimates: false, then materialize again.",
                        scope=lim.scope,
                        budget_usd=lim.budget_usd,
                        spent_usd=before,
                        needed_usd=need,
                    )
                )

    def check_planned(self, share: float = 1.0) -> None:
        """Check the deferred planner estimate (``planned_usd``, the whole stage) for the ``share`` of the
        stage still to pay for: a teacher stage's uncached requests, known only after the cache lookup.
        (Earlier stopped attempts are not subtracted: what they paid for is in the cache, outside ``share``.)"""
        if self.planned_usd is not None:
            self.check_estimate(self.planned_usd * max(0.0, min(1.0, share)))

    # ------------------------------------------------------------------ during
    def charge(
        self,
        *,
        items: int = 1,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        seconds: float = 0.0,
        final: bool = False,
    ) -> None:
        """Add what newly paid work used (tokens from a response, seconds of generation; never a cache hit),
        then check the budget (``final``: the paid work is complete)."""
        with self._lock:
            u = self.usage
            u.items += items
            u.prompt_tokens += int(prompt_tokens or 0)
            u.completion_tokens += int(completion_tokens or 0)
            u.seconds += float(seconds or 0.0)
        self.check(final=final)

    def accrued_lines(self) -> list[dict]:
        """What this attempt has accrued: time on hardware (``line_fn``) and reported usage (``metered``)."""
        lines = [] if self.line_fn is None else list(self.line_fn(self.clock() - self.t0, self.items))
        if self.metered is not None:
            with self._lock:
                lines += self.metered(Usage(**vars(self.usage)))
        return lines

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
        if now > self._last_usd:  # a chunk that paid nothing (one more answer of a batch already timed) is no chunk
            self._step_usd = now - self._last_usd
        self._last_usd = now
        step = 0.0 if final else self._step_usd
        for lim in self.limits:
            before = lim.spent_elsewhere()
            if before + now + step > lim.budget_usd:
                self.stopped, self.interrupted_usd = True, now
                self.ledger.record_interrupted(
                    campaign=self.campaign,
                    asset=self.stage,
                    run_id=self.run_id,
                    step_key=self.step_key,
                    attempt=self.attempt,
                    stage_key=self.stage_key,
                    lines=lines,
                    part=self.part,
                )
                spent = before + now
                self.log(f"budget stop in {self.stage}: recorded ${now:.6f} of interrupted spend")
                raise self.on_exceeded(
                    BudgetExceeded(
                        f"budget: stopped {self.stage} mid-way: {lim.scope} has spent ${spent:.6f} of its "
                        f"${lim.budget_usd:.6f} budget (this attempt ${now:.6f}, recorded in the ledger as "
                        f"interrupted); ${max(0.0, lim.budget_usd - spent):.6f} remains and the next chunk would cost "
                        f"about ${step:.6f}. Work finished so far is kept: raise the budget and materialize again to "
                        "resume.",
                        scope=lim.scope,
                        budget_usd=lim.budget_usd,
                        spent_usd=spent,
                        needed_usd=step,
                    )
                )

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


def limits_for(
    ledger: Ledger,
    campaign: str,
    stage: str,
    budget_usd: float | None,
    stage_budget_usd: float | None,
    run_id: str | None = None,
) -> list[Limit]:
    """The limits that apply to ``stage``, with the ledger's spend so far (``run_id``: this run only)."""
    out = []
    if budget_usd is not None:
        out.append(Limit(f"campaign {campaign}", budget_usd, ledger.spent(campaign, run_id=run_id)))
    if stage_budget_usd is not None:
        out.append(Limit(f"stage {stage}", stage_budget_usd, ledger.spent(campaign, asset=stage, run_id=run_id)))
    return out
