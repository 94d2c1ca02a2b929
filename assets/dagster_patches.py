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
:func:`check_internals` compares the installed Dagster version and the source of every patched or
relied-on Dagster function with what these patches were tested against. :func:`require_tested_dagster`
turns a difference into :class:`UntestedDagsterError` (naming the tested and installed versions and
each changed function) when the code location loads (``campaign_app/definitions.py``), in
``campaign run`` and in :func:`install`, so a Dagster upgrade never runs with blindly misapplied
patches; ``CAMPAIGN_ALLOW_UNTESTED_DAGSTER=1`` accepts the risk (a warning instead). The check hashes
seven function sources (a few milliseconds) and imports nothing beyond Dagster.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import signal
import sys
import threading
import time
import warnings

import dagster

try:  # a Dagster that moved these modules is reported by check_internals, not by an ImportError here
    import dagster._core.execution.api as _api
    import dagster._core.execution.plan.active as _active
    import dagster._core.execution.plan.execute_plan as _execute_plan
    import dagster._utils.interrupts as _interrupts
    from dagster._core.errors import DagsterExecutionInterruptedError
    from dagster._core.execution.plan.active import ActiveExecution
    from dagster._core.execution.plan.instance_concurrency_context import InstanceConcurrencyContext

    _IMPORT_ERROR: str | None = None
except ImportError as _e:
    _IMPORT_ERROR = f"{type(_e).__name__}: {_e}"

DAGSTER_VERSION = "1.13.27"
OVERRIDE_ENV = "CAMPAIGN_ALLOW_UNTESTED_DAGSTER"
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


def _resolve(get):
    try:
        return get()
    except (NameError, AttributeError):  # the module did not import, or the function is gone
        return None


_ORIGINALS = {
    "InstanceConcurrencyContext.interval_to_next_pending_claim_check": _resolve(
        lambda: InstanceConcurrencyContext.interval_to_next_pending_claim_check
    ),
    "ActiveExecution.sleep_til_ready": _resolve(lambda: ActiveExecution.sleep_til_ready),
    "ActiveExecution.concurrency_event_iterator": _resolve(lambda: ActiveExecution.concurrency_event_iterator),
    "interrupts._replace_interrupt_signal": _resolve(lambda: _interrupts._replace_interrupt_signal),
    "interrupts.capture_interrupts": _resolve(lambda: _interrupts.capture_interrupts),
    "execute_plan.inner_plan_execution_iterator": _resolve(lambda: _execute_plan.inner_plan_execution_iterator),
    "api.job_execution_iterator": _resolve(lambda: _api.job_execution_iterator),
}

_state: dict = {"instance": None, "run_id": None, "canceling_reported": False, "signal": None}
_installed = False


def source_hash(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def check_internals() -> list[str]:
    """What differs from the Dagster these patches were tested against (empty: nothing)."""
    problems = []
    if dagster.__version__ != DAGSTER_VERSION:
        problems.append(f"dagster is {dagster.__version__}, the patches were tested against {DAGSTER_VERSION}")
    if _IMPORT_ERROR:
        problems.append(f"a patched Dagster module does not import: {_IMPORT_ERROR}")
    for name, fn in _ORIGINALS.items():
        try:
            got = source_hash(fn) if fn is not None else None
        except (OSError, TypeError):  # no source to read (a C function, a zipped install)
            got = "unreadable"
        if got is None:
            problems.append(f"{name} is gone (the patches replace or rely on it)")
        elif got != EXPECTED_SOURCES[name]:
            problems.append(f"{name} changed (source sha256 {got}, tested {EXPECTED_SOURCES[name]})")
    return problems


class UntestedDagsterError(RuntimeError):
    """The installed Dagster is not the one the patches were tested against (see :func:`require_tested_dagster`)."""


class UntestedDagsterWarning(UserWarning):
    """The installed Dagster is untested, and ``CAMPAIGN_ALLOW_UNTESTED_DAGSTER=1`` accepted the risk."""


_warned: list[str] = []  # where the override's warning was given (once per process)


def untested_message(problems: list[str], where: str) -> str:
    return (
        f"{where}: the installed Dagster is not the one assets/dagster_patches.py was tested against "
        f"(tested: dagster {DAGSTER_VERSION}, installed: dagster {dagster.__version__}):\n"
        + "".join(f"  - {p}\n" for p in problems)
        + "The patches of Dagster internals that `campaign run` needs (a wait for a pool slot sleeps and says "
        "who holds it; SIGTERM/Ctrl-C cancel the run) could be misapplied. Install the tested version "
        f"(pip install dagster=={DAGSTER_VERSION}, as pinned in pyproject.toml), or read the changed "
        "functions, adapt the patches and update DAGSTER_VERSION / EXPECTED_SOURCES in "
        f"assets/dagster_patches.py; to run anyway at your own risk, set {OVERRIDE_ENV}=1."
    )


def require_tested_dagster(where: str, environ=None) -> list[str]:
    """Raise :class:`UntestedDagsterError` when :func:`check_internals` finds a difference; with
    ``CAMPAIGN_ALLOW_UNTESTED_DAGSTER=1`` warn instead (once per process). Returns the differences."""
    problems = check_internals()
    if not problems:
        return []
    msg = untested_message(problems, where)
    if (os.environ if environ is None else environ).get(OVERRIDE_ENV, "").strip() == "1":
        if not _warned:
            _warned.append(where)
            warnings.warn(
                f"{msg} ({OVERRIDE_ENV}=1: running with the untested Dagster)", UntestedDagsterWarning, stacklevel=2
            )
        return problems
    raise UntestedDagsterError(msg)


def refuse_untested_dagster(where: str = "campaign run", file=None) -> bool:
    """For the CLI: True (after printing why) when :func:`require_tested_dagster` refuses; the
    override's warning is printed too."""
    out = file or sys.stderr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UntestedDagsterWarning)
        try:
            require_tested_dagster(where)
        except UntestedDagsterError as e:
            print(e, file=out)
            return True
    for w in caught:
        print(f"warning: {w.message}", file=out)
    return False


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
            instance.report_run_canceling(
                run, message=f"`campaign run` received {signal.Signals(signum).name}: canceling the run"
            )

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
            log.info(
                ("reaped the dead run(s) " + ", ".join(reaped) + "; " if reaped else "")
                + "waiting for a slot of "
                + describe_holders(plan_context.instance, pool)
            )
        except Exception as e:  # noqa: BLE001 - a log line must never break the run
            plan_context.log.warning(f"could not describe who holds the pool: {e!r}")


# ---------------------------------------------------------------------------------------------- apply


def install() -> None:
    """Apply the four patches (once per process). Call in the main thread before executing."""
    global _installed
    if _installed:
        return
    require_tested_dagster("installing the Dagster patches")  # never patch an untested Dagster blind
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
