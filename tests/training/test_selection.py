"""training/selection.py: the kept checkpoint is the best by held-out loss, not the last (a planted over-trained
tail), ties keep the earlier one, patience stops training, and packed rows split into task and replay."""

from __future__ import annotations

from training.selection import Selector, split_rows


def test_an_over_trained_tail_keeps_the_best_checkpoint_not_the_last():
    sel = Selector(replay_weight=0.5)
    # held-out task loss falls, then rises as the student memorises; replay loss rises as it forgets
    planted = [(5, 2.0, 1.0), (10, 1.2, 1.1), (15, 0.8, 1.2), (20, 0.9, 1.6), (25, 1.3, 2.2)]
    for step, task, replay in planted:
        sel.observe(step, task, replay)
    assert sel.best.step == 15 and sel.best.score == 0.5 * 0.8 + 0.5 * 1.2
    s = sel.summary(last_step=25)
    assert s["kept_step"] == 15 and "step 15 of 25" in s["reason"] and "2 later evaluation" in s["reason"]
    assert [e["step"] for e in s["evaluations"]] == [5, 10, 15, 20, 25]


def test_replay_weight_decides_between_task_and_replay():
    evals = [(5, 1.0, 1.0), (10, 0.6, 1.6)]  # the task improves, replay degrades more
    forgetful, task_only = Selector(replay_weight=0.5), Selector(replay_weight=0.0)
    for step, t, r in evals:
        forgetful.observe(step, t, r)
        task_only.observe(step, t, r)
    assert forgetful.best.step == 5 and task_only.best.step == 10


def test_a_tie_or_a_change_within_min_delta_keeps_the_earlier_checkpoint():
    sel = Selector(min_delta=0.05)
    for step, loss in [(5, 1.0), (10, 1.0), (15, 0.97)]:
        sel.observe(step, loss, None)
    assert sel.best.step == 5


def test_patience_stops_after_n_evaluations_without_improvement():
    sel = Selector(patience=2)
    sel.observe(5, 1.0, None)
    assert not sel.should_stop
    sel.observe(10, 1.1, None)
    assert not sel.should_stop
    sel.observe(15, 1.2, None)
    assert sel.should_stop and "stopped early" in sel.reason(15)
    assert Selector().should_stop is False  # no patience: never


def test_missing_losses_fall_back_to_the_other_split():
    sel = Selector()
    assert sel.score(None, 2.0) == 2.0 and sel.score(1.0, None) == 1.0 and sel.score(None, None) is None


def test_rows_split_by_their_majority_of_replay_examples():
    rows = [["a", "b"], ["replay:x", "replay:y", "c"], ["replay:z", "d"], ["replay:q"]]
    assert split_rows(rows) == {"task": [0, 2], "replay": [1, 3]}
