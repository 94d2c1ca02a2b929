"""``python kill_after_checkpoint.py JOB STEP``: the trainer, SIGKILLed by itself right after checkpoint ``STEP`` is
complete (a kill at an exact place, so the test knows which state the relaunch finds)."""

import os
import signal
import sys

from training import recipes


def main(job_file: str, kill_at: int) -> None:
    save = recipes.LoraFinetuneRecipe.save_checkpoint

    def save_then_die(self, step: int, reason: str) -> None:
        save(self, step, reason)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    recipes.LoraFinetuneRecipe.save_checkpoint = save_then_die
    recipes.run(job_file)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
