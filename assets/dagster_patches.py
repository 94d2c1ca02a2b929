"""Four small patches of Dagster internals (dagster 1.13.27) that ``campaign run`` needs, in one place.

``campaign run`` executes a campaign in its own process (``JobDefinition.execute_in_process``, the
in-process executor). There, waiting for a pool slot and being stopped by a signal go wrong:

1. **A step waiting for a pool slot spins a core at 100 %.**
   ``InstanceConcurrencyContext.interval_to_next_pending_claim_check``
   (``dagster/_core/execution/plan/instance_concurrency_context.py``) returns
   ``min([0, *intervals])``, which is never positive, so ``ActiveExecution.sleep_til_ready`` never
   sleeps and ``inner_plan_execution_iterator`` (``execute_plan.py``) loops without pause between
   the claim polls (an upstream bug; Dagster's own tests stub this method). Patched to
   ``max(0, min(intervals))``: the loop sleeps until the next claim check is due.
2. **SIGTERM and Ctrl-C are ignored while a step waits for a slot.** Dagster captures the signal
   (``dagster/_utils/interrupts.py``, ``capture_interrupts``) but the in-process wait loop never
   looks at the captured flag (the multiprocess executor does), so a run waiting behind a dead
   holder can only be stopped with SIGKILL, which leaves one more dead run. Patched:
   ``ActiveExecution.sleep_til_ready`` sleeps in 0.2 s slices and raises
   ``DagsterExecutionInterruptedError`` once an interrupt was captured; ``job_execution_iterator``
   (``dagster/_core/execution/api.py``) then ends the run and ``InstanceConcurrencyContext.__exit__``
   withdraws its pending claim.
3. **A signalled run ends FAILURE ("interrupted unexpectedly"), not CANCELED.**
   ``job_execution_iterator`` reports an interrupted run as canceled only when the run is already
   ``CANCELING``; nothing in an in-process run sets that. Patched: every SIGINT/SIGTERM handler
   Dagster installs through ``_replace_interrupt_signal`` (a module global, looked up at call time)
   is wrapped so the first signal first reports ``CANCELING`` for the run bound with :func:`bind`
   (from a helper thread, joined for at most 5 s: a database write from the interrupted frame could
   wait on a lock that frame holds), then calls Dagster's handler. Outside a run, SIGTERM raises
   ``KeyboardInterrupt`` like Ctrl-C.
4. **The wait says only "Step blocked by limit for pool teacher", once and then every 5 minutes.**
   ``ActiveExecution.concurrency_event_iterator`` is wrapped: after each such event the step also
   logs who holds the pool, in which run and process, since when (``assets/run_recovery.py``,
   ``describe_holders``), and reaps a holder whose process is gone; the event repeats every minute
   (``dagster._core.execution.plan.active.CONCURRENCY_CLAIM_MESSAGE_INTERVAL``, a module global
   read at call time: 300 s upstream).

:func:`install` applies them once per process (``campaign run`` calls it before executing).
:func:`check_internals` compares the source of every patched or relied-on Dagster function with
what these patches were written against; ``tests/assets/test_dagster_patches.py`` fails when a
Dagster upgrade changes any of them, so the patches are re-read (and dropped once fixed upstream)
rather than silently misapplied.
"""

from __future__ import annotations

import hashlib
import inspect
import signal
import threading
import time

import dagster
import dagster._core.execution.api as _api
import dagster._core.execution.plan.active as _active
import dagster._core.execution.plan.execute_plan as _execute_plan
import dagster._utils.interrupts as _interrupts
from dagster._core.errors import DagsterExecutionInterruptedError
from dagster._core.execution.plan.active import ActiveExecution
from dagster._core.execution.plan.instance_concurrency_context import InstanceConcurrencyContext

DAGSTER_VERSION = "1.13.27"
HOLDER_LOG_EVERY_S = 60
SLEEP_SLICE_S = 0.2
CANCEL_REPORT_TIMEOUT_S = 5.0

# sha256 (first 16 hex) of the source of each Dagster function the patches replace or rely on, as of
# DAGSTER_VERSION. A different hash: read the new source, adapt or drop the patch, update the hash.
EXPECTED_SOURCES = {
    "InstanceConcurrencyContext.interval_to_next_pending_claim_check": "d9b44ab68eb41a99",
    "ActiveExecution.sleep_til_ready": "bad9225fc3c67290",
    "ActiveExecution.concurrency_event_iterator": "e825f2aadcb04e9b",
    "interrupts._replace_interrupt_signal": "2c870768e6429bde",
    "interrupts.capture_interrupts": "9092d28bdcd6461b",
    "execute_plan.inner_plan_execution_iterator": "87243a56e08e8a6a",
    "api.job_execution_iterator": "49ba219757f1e583",
}

_ORIGINALS = {
    "InstanceConcurrencyContext.interval_to_next_pending_claim_check":
        InstanceConcurrencyContext.interval_to_next_pending_claim_check,
    "ActiveExecution.sleep_til_ready": ActiveExecution.sleep_til_ready,
    "ActiveExecution.concurrency_event_iterator": ActiveExecution.concurrency_event_iterator,
    "interrupts._replace_interrupt_signal": _interrupts._replace_interrupt_signal,
    "interrupts.capture_interrupts": _interrupts.capture_interrupts,
    "execute_plan.inner_plan_execution_iterator": _execute_plan.inner_plan_execution_iterator,
    "api.job_execution_iterator": _api.job_execution_iterator,
}

_state: dict = {"instance": None, "run_id": None, "canceling_reported": False, "signal": None}
_installed = False


def source_hash(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def check_internals() -> list[str]:
    """What differs from the Dagster these patches were written for (empty: nothing)."""
    problems = []
    if dagster.__version__ != DAGSTER_VERSION:
        problems.append(f"dagster is {dagster.__version__}, the patches were written against {DAGSTER_VERSION}")
    for name, fn in _ORIGINALS.items():
        got = source_hash(fn)
        if got != EXPECTED_SOURCES[name]:
            problems.append(f"{name} changed (source sha256 {got}, expected {EXPECTED_SOURCES[name]})")
    return problems


# ---------------------------------------------------------------------------------------------- 1


def _interval_to_next_pending_claim_check(self: InstanceConcurrencyContext) -> float:
    if not self._pending_claims:
        return 0.0
    now = time.time()
    return max(0.0, min((ready_at - now for ready_at in self._pending_timeouts.values()), default=0.0))


# ---------------------------------------------------------------------------------------------- 2


def _sleep_til_ready(self: ActiveExecution) -> None:
    deadline = time.monotonic() + max(0.0, self.sleep_interval())
    while True:
        if _interrupts.pop_captured_interrupt():
            raise DagsterExecutionInterruptedError("interrupted while waiting for a pool slot or a retry")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(SLEEP_SLICE_S, left))


# ---------------------------------------------------------------------------------------------- 3


def _report_canceling(signum: int) -> None:
    instance, run_id = _state["instance"], _state["run_id"]
    if instance is None or run_id is None or _state["canceling_reported"]:
        return
    _state["canceling_reported"] = True
    _state["signal"] = signum

    def work() -> None:
        run = instance.get_run_by_id(run_id)
        if run is not None and not run.is_finished:
            instance.report_run_canceling(run, message=f"`campaign run` received {signal.Signals(signum).name}: "
                                                       "canceling the run")

    t = threading.Thread(target=work, name="report-canceling", daemon=True)
    t.start()
    t.join(timeout=CANCEL_REPORT_TIMEOUT_S)


def _wrap(handler):
    if not callable(handler) or getattr(handler, "_campaign_wrapped", None) is not None:
        return handler

    def wrapped(signum, frame):
        _report_canceling(signum)
        return handler(signum, frame)

    wrapped._campaign_wrapped = handler
    return wrapped


def _replace_interrupt_signal(new_signal_handler) -> None:
    handler = _wrap(getattr(new_signal_handler, "_campaign_wrapped", new_signal_handler))
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)  # as Dagster's setup_interrupt_handlers: SIGTERM behaves as SIGINT


# ---------------------------------------------------------------------------------------------- 4


def _concurrency_event_iterator(self: ActiveExecution, plan_context):
    from assets.run_recovery import describe_holders, reap_dead_runs

    for event in _ORIGINALS["ActiveExecution.concurrency_event_iterator"](self, plan_context):
        yield event
        try:
            step = self.get_step_by_key(event.step_key)
            pool = step.pool
            log = plan_context.for_step(step).log
            if not pool:
                continue
            reaped = reap_dead_runs(plan_context.instance, log=log.warning, pool=pool)
            log.info(("reaped the dead run(s) " + ", ".join(reaped) + "; " if reaped else "")
                     + "waiting for a slot of " + describe_holders(plan_context.instance, pool))
        except Exception as e:  # noqa: BLE001 - a log line must never break the run
            plan_context.log.warning(f"could not describe who holds the pool: {e!r}")


# ---------------------------------------------------------------------------------------------- apply


def install() -> None:
    """Apply the four patches (once per process). Call in the main thread before executing."""
    global _installed
    if _installed:
        return
    _installed = True
    InstanceConcurrencyContext.interval_to_next_pending_claim_check = _interval_to_next_pending_claim_check
    ActiveExecution.sleep_til_ready = _sleep_til_ready
    _interrupts._replace_interrupt_signal = _replace_interrupt_signal
    ActiveExecution.concurrency_event_iterator = _concurrency_event_iterator
    _active.CONCURRENCY_CLAIM_MESSAGE_INTERVAL = HOLDER_LOG_EVERY_S
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # outside a run: like Ctrl-C


def bind(instance, run_id: str) -> None:
    """The run a SIGINT/SIGTERM cancels from now on (its id is known before execution starts)."""
    _state.update(instance=instance, run_id=run_id, canceling_reported=False, signal=None)


def received_signal() -> int | None:
    """The signal that canceled the bound run, if any."""
    return _state["signal"]
