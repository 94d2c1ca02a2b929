"""The patches of Dagster internals (assets/dagster_patches.py) still fit the Dagster installed: a
Dagster upgrade that changes a patched or relied-on function fails here, so the patches are re-read
(and dropped once fixed upstream) instead of silently misapplied; and the same check refuses to load
the code location, to start `campaign run` or to install the patches on an untested Dagster (unless
CAMPAIGN_ALLOW_UNTESTED_DAGSTER=1, then a warning). Their effect is tested end to end in
tests/e2e/test_crash_recovery.py (a waiting run sleeps, SIGTERM and Ctrl-C cancel it)."""

import runpy
import time
import warnings

import dagster
import pytest
from dagster._core.execution.plan.active import ActiveExecution
from dagster._core.execution.plan.instance_concurrency_context import InstanceConcurrencyContext

from assets import dagster_patches
from assets.dagster_patches import OVERRIDE_ENV, UntestedDagsterError, UntestedDagsterWarning
from tests.support import REPO_ROOT

DEFINITIONS = str(REPO_ROOT / "campaign_app" / "definitions.py")


@pytest.fixture
def untested(monkeypatch):
    """No override in the environment, and the override's once-per-process warning not yet given."""
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(dagster_patches, "_warned", [])
    return monkeypatch


def test_the_patched_dagster_functions_are_the_ones_the_patches_were_written_for():
    assert dagster_patches.check_internals() == []


@pytest.fixture
def fresh_install(monkeypatch):
    """``dagster_patches.install()`` run afresh on the upstream functions; everything it sets is restored after."""
    import signal

    import dagster._core.execution.plan.active as active
    import dagster._utils.interrupts as interrupts

    originals = dagster_patches._ORIGINALS
    monkeypatch.setattr(
        InstanceConcurrencyContext,
        "interval_to_next_pending_claim_check",
        originals["InstanceConcurrencyContext.interval_to_next_pending_claim_check"],
    )
    for name in ("sleep_til_ready", "concurrency_event_iterator"):
        monkeypatch.setattr(ActiveExecution, name, originals[f"ActiveExecution.{name}"])
    monkeypatch.setattr(interrupts, "_replace_interrupt_signal", interrupts._replace_interrupt_signal)
    monkeypatch.setattr(active, "CONCURRENCY_CLAIM_MESSAGE_INTERVAL", active.CONCURRENCY_CLAIM_MESSAGE_INTERVAL)
    monkeypatch.setattr(dagster_patches, "_installed", False)
    sigterm = signal.getsignal(signal.SIGTERM)
    yield dagster_patches.install
    signal.signal(signal.SIGTERM, sigterm)


def test_the_claim_interval_is_never_negative_after_the_patch(fresh_install):
    """Upstream returns min([0, ...]) <= 0, so the in-process executor never sleeps while it waits; once installed,
    the executor's own method waits until the pending claim's next check."""

    class Ctx:
        _pending_claims = {"step"}
        _pending_timeouts = {"step": time.time() + 2.0}

    assert InstanceConcurrencyContext.interval_to_next_pending_claim_check(Ctx()) == 0  # the upstream bug
    fresh_install()
    assert 1.5 < InstanceConcurrencyContext.interval_to_next_pending_claim_check(Ctx()) <= 2.0


def test_the_installed_dagster_passes_the_checks_silently(untested):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dagster_patches.require_tested_dagster("here") == []
        assert dagster_patches.refuse_untested_dagster("campaign run") is False


def test_another_dagster_version_fails_the_code_location_load_naming_both_versions(untested):
    untested.setattr(dagster, "__version__", "1.14.0")
    with pytest.raises(UntestedDagsterError) as e:
        runpy.run_path(DEFINITIONS)  # what `dagster dev` / the webserver executes to load the location
    msg = str(e.value)
    assert msg.startswith("loading the code location campaign_app/definitions.py: ")
    assert "(tested: dagster 1.13.27, installed: dagster 1.14.0)" in msg, msg
    assert "dagster is 1.14.0, the patches were tested against 1.13.27" in msg
    assert "pip install dagster==1.13.27" in msg and f"{OVERRIDE_ENV}=1" in msg
    assert " changed (" not in msg  # the functions themselves are the tested ones


def test_a_changed_patched_function_is_named(untested):
    def sleep_til_ready(self):  # what an upgrade that rewrote the function looks like to the check
        return None

    before = ActiveExecution.sleep_til_ready
    untested.setattr(
        dagster_patches,
        "_ORIGINALS",
        {**dagster_patches._ORIGINALS, "ActiveExecution.sleep_til_ready": sleep_til_ready},
    )
    untested.setattr(dagster_patches, "_installed", False)
    with pytest.raises(UntestedDagsterError) as e:
        dagster_patches.install()
    msg = str(e.value)
    assert "(tested: dagster 1.13.27, installed: dagster 1.13.27)" in msg, msg
    assert "ActiveExecution.sleep_til_ready changed (source sha256 " in msg
    assert "tested bad9225fc3c67290" in msg and msg.count(" changed (") == 1
    assert dagster_patches._installed is False and ActiveExecution.sleep_til_ready is before  # nothing was patched


def test_campaign_run_refuses_an_untested_dagster_before_anything_runs(untested, tmp_path, capsys):
    from campaign_app.cli import EXIT_INVALID, main

    untested.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    untested.setattr(dagster, "__version__", "1.14.0")
    installed = []
    untested.setattr(dagster_patches, "install", lambda: installed.append(1))
    assert main(["run", "demo", "--artifacts", str(tmp_path / "artifacts")]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith("campaign run: the installed Dagster is not the one"), err
    assert "installed: dagster 1.14.0" in err and OVERRIDE_ENV in err
    assert installed == [] and not (tmp_path / "artifacts").exists()


def test_the_override_turns_the_refusal_into_one_warning(untested, capsys):
    untested.setenv(OVERRIDE_ENV, "1")
    untested.setattr(dagster, "__version__", "1.14.0")
    with pytest.warns(UntestedDagsterWarning, match=r"(?s)installed: dagster 1\.14\.0.*running with the untested"):
        assert dagster_patches.require_tested_dagster("loading the code location") == [
            "dagster is 1.14.0, the patches were tested against 1.13.27"
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second check does not warn again
        assert dagster_patches.require_tested_dagster("campaign run")
    untested.setattr(dagster_patches, "_warned", [])
    assert dagster_patches.refuse_untested_dagster("campaign run") is False  # the CLI goes on, and says so
    assert capsys.readouterr().err.startswith("warning: campaign run: the installed Dagster is not the one")
