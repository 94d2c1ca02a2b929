"""The local models' answers (the student's base, a candidate): the identity their answers are cached under and the
batch they answer in. Read by evaluation, by the executors that run the answering and by the distillation set's
base-answer targets, so it sits below all three (``tests/test_layers.py`` fails on an import circle)."""

from __future__ import annotations

from campaigns.spec import CampaignSpec
from stages.common import model_identity


def batch_size(spec: CampaignSpec) -> int:
    """The batch the local models answer in: the largest of the suites'."""
    return max(x.batch_size for x in spec.evaluation.suites)


def local_quantization_key(q) -> dict:
    """The student's quantization settings as they key local answers, ``compute_dtype`` resolved for this host
    (``<device kind>:<dtype>``: the models load where ``LocalModel`` puts them), never ``auto``."""
    from campaign_orchestrator.hardware import key_precision

    return q.model_dump() | {"compute_dtype": key_precision(q.compute_dtype)}


def answer_identity(spec: CampaignSpec, base, adapter: dict | None) -> tuple[str, str]:
    """``(identity, precision)`` under which the student's base (``adapter`` None) or a candidate caches its
    answers: its weights, the compute dtype resolved for where it runs (``<device kind>:<dtype>``), the adapter's
    content key, its 4-bit settings. The base's is a ``transformers`` teacher's identity over the same weights and
    precision, so a context-distillation teacher's bare-prompt answers are the base's (answered once)."""
    from campaign_orchestrator.generation.backends import answer_identity as identity_of

    s, q = spec.student, spec.student.quantization
    precision = local_quantization_key(q)["compute_dtype"]
    return identity_of(
        s.base_model,
        base,
        s.revision,
        weights_id=model_identity(base, s.revision),
        precision=precision,
        adapter_id=adapter["key"] if adapter else None,
        quantization=q.model_dump() if q.load_in_4bit else None,
    ), precision
