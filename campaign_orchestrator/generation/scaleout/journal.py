"""A worker's usage journal: what each request of a shard attempt could cost, and what each answer did cost, written
as it happens, so a worker killed mid-shard leaves its money accounted for.

The worker's client (``OpenAICompatibleClient.journal``) writes a line before it sends a request (its key and its
usage's upper bound: prompt bytes plus overhead, and ``max_tokens``) and a line as soon as an answer is received,
before the answer is handed on (its usage as the server billed it). Each line is flushed to the kernel as it is
written: it survives the worker's SIGKILL, as the cache's spool does. When a worker is lost the pool reads its
journal (:func:`read_journal`): every answer received is billed from its usage (verified), whether or not it reached
the spool; every request sent and never answered (in flight at the kill: its usage is unknown) is billed at its upper
bound, marked paid-unverified. So the ledger is never below what the server served.

One file per shard attempt (``<spool dir>/journal/<worker>-<shard>-<attempt>.jsonl``), removed when the attempt
ends or once the pool has billed it. Local to the worker's node, like its spool: a node lost with its machine takes
its journal along (its shard's in-flight requests are then billed as before, up to the last progress poll).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path


def journal_path(spool_dir: str | Path, worker: str, shard: str, attempt: int) -> Path:
    return Path(spool_dir) / "journal" / f"{worker}-{shard}-{attempt}.jsonl"


class UsageJournal:
    """Appends ``sent`` and ``received`` lines for one shard attempt (thread-safe; flushed per line)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def _write(self, record: dict) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()  # in the kernel now: survives SIGKILL of this process

    def sent(self, req, bound: tuple[int, int]) -> None:
        self._write({"sent": req.key, "bound": [int(bound[0]), int(bound[1])]})

    def received(self, req, completion) -> None:
        self._write(
            {
                "got": req.key,
                "ok": bool(completion.ok),
                "prompt_tokens": int(completion.prompt_tokens or 0),
                "completion_tokens": int(completion.completion_tokens or 0),
            }
        )

    def close(self, remove: bool = True) -> None:
        """Stop writing; ``remove``: the attempt ended in its own process, so nobody needs its journal."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        if remove:
            self.path.unlink(missing_ok=True)


@dataclass
class JournalTally:
    """What a shard attempt's journal says: the answers received (``answers``, of them ``ok``) and their billed
    tokens, and the requests sent and never answered (``in_flight``) with the sum of their upper bounds."""

    answers: int = 0
    ok: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    bound_prompt_tokens: int = 0
    bound_completion_tokens: int = 0
    in_flight_keys: list[str] = field(default_factory=list)


def read_journal(path: str | Path) -> JournalTally | None:
    """The tally of a journal (None: there is none, e.g. a backend without a client to journal); a line cut by the
    kill (the last one, unterminated) is skipped."""
    p = Path(path)
    if not p.exists():
        return None
    sent: dict[str, list[int]] = {}
    got: dict[str, dict] = {}
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "sent" in rec:
            sent[rec["sent"]] = rec["bound"]
        elif "got" in rec:
            got[rec["got"]] = rec
    t = JournalTally()
    for r in got.values():
        t.answers += 1
        t.ok += int(r["ok"])
        t.prompt_tokens += r["prompt_tokens"]
        t.completion_tokens += r["completion_tokens"]
    for k, (bp, bc) in sent.items():
        if k not in got:
            t.in_flight += 1
            t.bound_prompt_tokens += bp
            t.bound_completion_tokens += bc
            t.in_flight_keys.append(k)
    return t
