"""What long work reports to as it goes, handed down by the stages (``stages/context.py``): a progress bar that logs
every ~10%, and a log over a ``logging.Logger``. They live here, below every layer that calls them, so a callback
never calls back up into the layer that handed it down (tests/stages/test_stages.py traces it)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from tqdm import tqdm


class RunProgress:
    """``progress(n)`` after ``n`` more units are done; ``log``: a callable taking one line (the run's logger)."""

    def __init__(self, log: Callable[[str], None], total: int, label: str, unit: str = "it"):
        self.log, self.total, self.label, self.unit = log, total, label, unit
        self.done = 0
        self.t0 = time.perf_counter()
        self._next = 0.1
        self.bar = tqdm(total=total, desc=label, unit=unit, file=sys.stderr, mininterval=1.0, leave=False)

    def __call__(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        frac = self.done / self.total if self.total else 1.0
        if frac >= self._next or self.done == self.total:
            rate = self.done / max(1e-9, time.perf_counter() - self.t0)
            self.log(f"{self.label}: {self.done}/{self.total} {self.unit} ({frac:.0%}, {rate:.1f} {self.unit}/s)")
            while self._next <= frac:
                self._next += 0.1

    def close(self) -> None:
        self.bar.close()


class LoggerLog:
    """A run log (``info``, ``warning``) over a ``logging.Logger`` (the default of a plain stage context)."""

    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or logging.getLogger("stages")

    def info(self, msg: str) -> None:
        self.logger.info(msg)

    def warning(self, msg: str) -> None:
        self.logger.warning(msg)
