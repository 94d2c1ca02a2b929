"""The one run tag that says who owns a ``campaign run`` run and what it started: :data:`OWNER_TAG`, compact JSON.

It is internal (only the run reaper reads it), so it is one of Dagster's hidden tags (prefix ``.dagster/``: the UI's
runs list and run page never show them, GraphQL leaves them out, ``DagsterRun.tags`` keeps them): the tags people read,
verdict and cost first, are not buried under a JSON blob. Runs recorded before that carry it as ``campaign/owner``.

``campaign run`` writes the owner process when it creates the run (``assets/run_recovery.py``: ``owner_tags``); the
launchers add what the reaper must remove if that process dies: the local launcher its trainers' process groups
(``trainers``), the Kubernetes launchers the cluster their workloads live in (``k8s``). Keys:

* ``host``, ``pid``, ``start`` (unix seconds): the owner process (a pid reused later is another process),
* ``boot_id``, ``pid_ns``: the kernel boot and PID namespace its pid means something in
  (``training.run_processes.identity``),
* ``trainers``: process groups (``training.run_processes.group_record``),
* ``k8s``: the cluster (namespace, kubeconfig_file, kube_context, in_cluster).

Runs recorded before this tag carry the same facts as ``campaign/owner`` or, older still, as separate tags
(:data:`LEGACY_TAGS`); :func:`read` falls back to them, so a run started before an upgrade is still judged (and its
leftovers removed) after it. The run lease (``assets/run_recovery.py``: ``LEASE_TAG``, hidden too) stays a tag of its
own: it is rewritten every renewal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from training import run_processes

HIDDEN = ".dagster/"  # Dagster's prefix of hidden tags (dagster._core.storage.tags.HIDDEN_TAG_PREFIX)
OWNER_TAG = f"{HIDDEN}campaign-owner"
VISIBLE_OWNER_TAG = "campaign/owner"  # the same record, as runs carried it before it was hidden (read, never written)
# the separate tags runs carried before VISIBLE_OWNER_TAG (read, never written)
LEGACY_TAGS = {
    "host": "campaign/host",
    "pid": "campaign/pid",
    "start": "campaign/start",
    "boot_id": "campaign/boot-id",
    "pid_ns": "campaign/pid-ns",
}
LEGACY_TRAINERS_TAG, LEGACY_K8S_TAG = "campaign/trainers", "campaign/k8s"


def _json(text: str | None, kind: type):
    try:
        value = json.loads(text or "null")
    except ValueError:
        return None
    return value if isinstance(value, kind) else None


def read(tags: Mapping[str, str]) -> dict:
    """The owner record of a run's tags: :data:`OWNER_TAG`, over ``campaign/owner`` and the separate tags of runs
    recorded before them (no ``pid`` for a run no ``campaign run`` owns). ``trainers`` is always there: a list of
    valid process groups."""
    owner: dict = {k: tags[t] for k, t in LEGACY_TAGS.items() if t in tags}
    owner["trainers"] = run_processes.decode_groups(tags.get(LEGACY_TRAINERS_TAG))
    if LEGACY_K8S_TAG in tags:
        owner["k8s"] = _json(tags[LEGACY_K8S_TAG], dict)
    owner |= _json(tags.get(VISIBLE_OWNER_TAG), dict) or {}
    owner |= _json(tags.get(OWNER_TAG), dict) or {}
    trainers = owner["trainers"]
    owner["trainers"] = run_processes.valid_groups(trainers if isinstance(trainers, list) else [])
    return owner


def encode(owner: Mapping) -> dict[str, str]:
    """``owner`` as the run tag (empty ``trainers`` left out)."""
    kept = {k: v for k, v in owner.items() if v is not None and not (k == "trainers" and not v)}
    return {OWNER_TAG: json.dumps(kept, separators=(",", ":"))}


def updated(tags: Mapping[str, str], **fields) -> dict[str, str]:
    """The owner tag of a run whose tags are ``tags``, with ``fields`` set (to pass to ``add_run_tags``)."""
    return encode(read(tags) | fields)
