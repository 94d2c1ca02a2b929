"""The patches of Dagster internals (assets/dagster_patches.py) still fit the Dagster installed: a
Dagster upgrade that changes a patched or relied-on function fails here, so the patches are re-read
(and dropped once fixed upstream) instead of silently misapplied. Their effect is tested end to end in
tests/e2e/test_crash_recovery.py (a waiting run sleeps, SIGTERM and Ctrl-C cancel it)."""

import time

from dagster._core.execution.plan.instance_concurrency_context import InstanceConcurrencyContext

from assets import dagster_patches


def test_the_patched_dagster_functions_are_the_ones_the_patches_were_written_for():
    assert dagster_patches.check_internals() == []


def test_the_claim_interval_is_never_negative_after_the_patch():
    """Upstream returns min([0, ...]) <= 0, so the in-process executor never sleeps while it waits."""

    class Ctx:
        _pending_claims = {"step"}
        _pending_timeouts = {"step": time.time() + 2.0}

    original = dagster_patches._ORIGINALS["InstanceConcurrencyContext.interval_to_next_pending_claim_check"]
    assert original(Ctx()) == 0  # the upstream bug: a claim 2 s away means "do not sleep"
    assert 1.5 < dagster_patches._interval_to_next_pending_claim_check(Ctx()) <= 2.0  # what install() puts there
    assert original is InstanceConcurrencyContext.interval_to_next_pending_claim_check or dagster_patches._installed
