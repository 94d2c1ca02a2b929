"""A process working on a sweep's Optuna study (``campaign_orchestrator.sweep``'s storage and study), for the
storage tests: ``pair`` runs trials that wait until two trials have been RUNNING at once (so two processes
write to the database concurrently), ``hang`` starts one trial that never ends (to be SIGKILLed).

    python -m tests.support.sweep_worker CAMPAIGN.yaml STUDY pair|hang
"""

import math
import sys
import time

from campaign_orchestrator.sweep import make_storage, make_study
from campaigns.loader import load_campaigns


def main(path: str, study_name: str, mode: str) -> None:
    import optuna
    from optuna.trial import TrialState

    spec = next(iter(load_campaigns([path]).campaigns.values()))
    study = make_study(spec, make_storage(spec.sweep.storage, spec.sweep), study_name)

    def objective(trial):
        lr = trial.suggest_float("training.learning_rate", 1e-4, 1.0, log=True)
        if mode == "hang":
            print(f"RUNNING {trial.number}", flush=True)
            while True:
                time.sleep(0.2)
        # wait until the two processes have had a trial RUNNING at the same time (the study remembers it: a
        # process's last trial may find the other process already done, and must not wait for it forever)
        deadline = time.monotonic() + 300  # the other process may start late on a loaded machine
        while not study.user_attrs.get("overlapped"):
            if len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))) >= 2:
                study.set_user_attr("overlapped", True)
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the other worker never had a trial running at the same time")
            time.sleep(0.05)
        for step in (10, 30):
            trial.report((math.log10(lr) + 2) ** 2 + 1 / step, step)
        return (math.log10(lr) + 2) ** 2

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=2 if mode == "pair" else 1)


if __name__ == "__main__":
    main(*sys.argv[1:])
