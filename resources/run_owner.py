"""The one run tag that says who owns a ``campaign run`` run and what it started: ``campaign/owner``, compact JSON.

``campaign run`` writes the owner process when it creates the run (``assets/run_recovery.py``: ``owner_tags``); the
launchers add what the reaper must remove if that process dies: the local launcher its trainers' process groups
(``trainers``), the Kubernetes launchers the cluster their workloads live in (``k8s``). Keys:

* ``host``, ``pid``, ``start`` (unix seconds): the owner process (a pid reused later is another process),
* ``boot_id``, ``pid_ns``: the kernel boot and PID namespace its pid means something in
  (``training.run_processes.identity``),
* ``trainers``: process groups (``training.run_processes.group_record``),
* ``k8s``: the cluster (namespace, kubeconfig_file, kube_context, in_cluster).

Runs recorded before this tag carry the same facts as separate tags (:data:`LEGACY_TAGS`); :func:`read` falls back to
them, so a run started before an upgrade is still judged (and its leftovers removed) after it. The run lease
(``campaign/lease-until``) stays a tag of its own: it is rewritten every renewal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from training import run_processes

OWNER_TAG = "campaign/owner"
# the separate tags runs carried before OWNER_TAG (read, never written)
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
    """The owner record of a run's tags: ``campaign/owner``, over the separate tags of a run recorded before it (no
    ``pid`` for a run no ``campaign run`` owns). ``trainers`` is always there: a list of valid process groups."""
    owner: dict = {k: tags[t] for k, t in LEGACY_TAGS.items() if t in tags}
    owner["trainers"] = run_processes.decode_groups(tags.get(LEGACY_TRAINERS_TAG))
    if LEGACY_K8S_TAG in tags:
        owner["k8s"] = _json(tags[LEGACY_K8S_TAG], dict)
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
