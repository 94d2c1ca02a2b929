"""Which checkpoint a training run returns: the best by held-out loss, not the last.

The rule (``training.selection.rule: best_heldout_loss``, fields in ``campaigns/spec/selection.py``):

* every ``every_steps`` optimizer steps the held-out loss is measured on the validation split (examples held out
  of training by id), apart for **task** rows and **replay** rows (``data.replay``; a packed row counts as replay
  when most of its examples are, :func:`split_rows`);
* the score is ``(1 - replay_weight) * task_loss + replay_weight * replay_loss`` (one of them alone when the other
  has no rows); the kept checkpoint has the lowest score; a later checkpoint replaces it only when it is lower by
  more than ``min_delta`` (a tie keeps the earlier, less trained one);
* with ``patience`` N, training stops after N evaluations in a row that did not replace the kept checkpoint.

Why held-out loss: the task loss on held-out items rises once the student memorises its training items (the
over-trained tail), and the replay loss rises as it forgets how the base answered everything else; both are
measured without generation, so each evaluation costs one forward pass over ``eval_rows`` rows.
No torch import: the trainer calls it with plain numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from campaign_orchestrator.dataset.replay import REPLAY_PREFIX  # the ids of replay examples (data.replay)


def is_replay(example_id: str) -> bool:
    return str(example_id).startswith(REPLAY_PREFIX)


def split_rows(example_ids: Sequence[Sequence[str]]) -> dict[str, list[int]]:
    """Indices of packed rows by kind: ``replay`` when most of a row's examples are replay examples, else ``task``."""
    out: dict[str, list[int]] = {"task": [], "replay": []}
    for i, ids in enumerate(example_ids):
        n = sum(is_replay(x) for x in ids)
        out["replay" if ids and n * 2 > len(ids) else "task"].append(i)
    return out


@dataclass
class Evaluation:
    step: int
    task_loss: float | None
    replay_loss: float | None
    score: float | None


@dataclass
class Selector:
    """Keeps the best evaluation by the rule above; :meth:`observe` returns True when it became the kept one."""

    replay_weight: float = 0.5
    min_delta: float = 0.0
    patience: int | None = None
    history: list[Evaluation] = field(default_factory=list)
    best: Evaluation | None = None
    since_best: int = 0

    def score(self, task_loss: float | None, replay_loss: float | None) -> float | None:
        if task_loss is None and replay_loss is None:
            return None
        if replay_loss is None:
            return task_loss
        if task_loss is None:
            return replay_loss
        return (1.0 - self.replay_weight) * task_loss + self.replay_weight * replay_loss

    def observe(self, step: int, task_loss: float | None, replay_loss: float | None) -> bool:
        ev = Evaluation(step, task_loss, replay_loss, self.score(task_loss, replay_loss))
        self.history.append(ev)
        if ev.score is not None and (
            self.best is None or self.best.score is None or ev.score < self.best.score - self.min_delta
        ):
            self.best, self.since_best = ev, 0
            return True
        self.since_best += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.best is not None and self.since_best >= self.patience

    def reason(self, last_step: int) -> str:
        if self.best is None:
            return "no held-out evaluation: the last step is kept"
        b = self.best
        parts = [
            f"task {b.task_loss:.4f}" if b.task_loss is not None else None,
            f"replay {b.replay_loss:.4f}" if b.replay_loss is not None else None,
        ]
        what = ", ".join(p for p in parts if p)
        later = [e for e in self.history if e.step > b.step]
        text = (
            f"step {b.step} of {last_step}: lowest held-out loss {b.score:.4f} ({what}; weight of replay "
            f"{self.replay_weight})"
        )
        if later:
            text += (
                f"; the {len(later)} later evaluation(s) did not improve it by more than {self.min_delta} "
                f"(best later {min(e.score for e in later if e.score is not None):.4f})"
            )
        if self.should_stop:
            text += f"; stopped early after {self.patience} evaluations without improvement"
        return text

    def summary(self, last_step: int) -> dict:
        return {
            "rule": "best_heldout_loss",
            "kept_step": self.best.step if self.best else last_step,
            "reason": self.reason(last_step),
            "replay_weight": self.replay_weight,
            "min_delta": self.min_delta,
            "patience": self.patience,
            "stopped_early": self.should_stop,
            "evaluations": [asdict(e) for e in self.history],
        }
