"""Progress for long work: a tqdm bar on stderr and a line in the run's log every ~10%."""

from __future__ import annotations

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
