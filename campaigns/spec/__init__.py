"""The campaign spec: one YAML file, validated by these pydantic models.

Every field is documented where it is declared. Unknown keys are errors (``extra="forbid"``),
so a typo never silently falls back to a default. This module imports only pydantic (and the
stdlib-only ``campaigns.paths``): the trainer, the evaluation code and the Dagster code
location all read the same models.

Model references: a model path is either a filesystem path (absolute, or relative to the
campaign's project directory, ``CampaignSpec.path``) or ``@demo/<name>``, a model built by the project's own
``demo`` step under the artifact root (see ``campaign_orchestrator/demo/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Discriminator, Field, PrivateAttr, Tag, field_serializer, field_validator, model_validator

from campaigns import paths
from campaigns.spec.automation import (
    AutomationSpec as AutomationSpec,
)
from campaigns.spec.automation import (
    DriftSpec as DriftSpec,
)
from campaigns.spec.automation import (
    ModelChangeSpec as ModelChangeSpec,
)
from campaigns.spec.automation import (
    NewDataSpec as NewDataSpec,
)

# Every section's models, importable from ``campaigns.spec`` as before the split (explicit re-exports).
from campaigns.spec.common import (
    SLUG as SLUG,
)
from campaigns.spec.common import FieldValueError, _Strict
from campaigns.spec.common import (
    S3Uri as S3Uri,
)
from campaigns.spec.cost import (
    CostSpec as CostSpec,
)
from campaigns.spec.cost import (
    PlannerSpec as PlannerSpec,
)
from campaigns.spec.cost import (
    PriceOverride as PriceOverride,
)
from campaigns.spec.cost import (
    ScheduleSpec as ScheduleSpec,
)
from campaigns.spec.data import (
    DatasetSpec as DatasetSpec,
)
from campaigns.spec.data import (
    DataSpec as DataSpec,
)
from campaigns.spec.data import (
    FilterSpec as FilterSpec,
)
from campaigns.spec.data import (
    HeldoutSpec as HeldoutSpec,
)
from campaigns.spec.evaluation import (
    EndpointSpec as EndpointSpec,
)
from campaigns.spec.evaluation import (
    EvaluationSpec as EvaluationSpec,
)
from campaigns.spec.evaluation import (
    GateRule as GateRule,
)
from campaigns.spec.evaluation import (
    GateSpec as GateSpec,
)
from campaigns.spec.evaluation import (
    StatisticsSpec as StatisticsSpec,
)
from campaigns.spec.evaluation import (
    SuiteSpec as SuiteSpec,
)
from campaigns.spec.execution import (
    ExecutionSpec as ExecutionSpec,
)
from campaigns.spec.kubernetes import (
    ENV_NAME as ENV_NAME,
)
from campaigns.spec.kubernetes import (
    K8S_LABEL_KEY as K8S_LABEL_KEY,
)
from campaigns.spec.kubernetes import (
    K8S_LABEL_VALUE as K8S_LABEL_VALUE,
)
from campaigns.spec.kubernetes import (
    K8S_NAME as K8S_NAME,
)
from campaigns.spec.kubernetes import (
    K8S_QUANTITY as K8S_QUANTITY,
)
from campaigns.spec.kubernetes import (
    K8S_SUBDOMAIN as K8S_SUBDOMAIN,
)
from campaigns.spec.kubernetes import (
    SECRET_LIKE_ENV as SECRET_LIKE_ENV,
)
from campaigns.spec.kubernetes import (
    KubernetesSpec as KubernetesSpec,
)
from campaigns.spec.kubernetes import (
    SecretEnvSpec as SecretEnvSpec,
)
from campaigns.spec.kubernetes import (
    SecretVolumeSpec as SecretVolumeSpec,
)
from campaigns.spec.kubernetes import (
    TolerationSpec as TolerationSpec,
)
from campaigns.spec.kubernetes import (
    VolumeClaimSpec as VolumeClaimSpec,
)
from campaigns.spec.lm_eval import (
    DecontaminationSpec as DecontaminationSpec,
)
from campaigns.spec.lm_eval import (
    LmEvalSpec as LmEvalSpec,
)
from campaigns.spec.student import (
    PARAM_WRAPPER_REFUSES as PARAM_WRAPPER_REFUSES,
)
from campaigns.spec.student import (
    LoraSpec as LoraSpec,
)
from campaigns.spec.student import (
    MoeSpec as MoeSpec,
)
from campaigns.spec.student import (
    QuantizationSpec as QuantizationSpec,
)
from campaigns.spec.student import (
    StudentSpec as StudentSpec,
)
from campaigns.spec.sweep import (
    ParamSpec as ParamSpec,
)
from campaigns.spec.sweep import (
    RungSpec as RungSpec,
)
from campaigns.spec.sweep import (
    SweepSpec as SweepSpec,
)
from campaigns.spec.teacher import (
    SINGLE_NAME as SINGLE_NAME,
)
from campaigns.spec.teacher import (
    UNPRICED as UNPRICED,
)
from campaigns.spec.teacher import (
    MessageSpec as MessageSpec,
)
from campaigns.spec.teacher import (
    SamplingSpec as SamplingSpec,
)
from campaigns.spec.teacher import (
    TeacherEntry as TeacherEntry,
)
from campaigns.spec.teacher import (
    TeacherList as TeacherList,
)
from campaigns.spec.teacher import (
    TeacherSpec as TeacherSpec,
)
from campaigns.spec.tracking import (
    MlflowSpec as MlflowSpec,
)
from campaigns.spec.tracking import (
    TrackingSpec as TrackingSpec,
)
from campaigns.spec.training import (
    CheckpointSpec as CheckpointSpec,
)
from campaigns.spec.training import (
    DiagnosticCommand as DiagnosticCommand,
)
from campaigns.spec.training import (
    DiagnosticsSpec as DiagnosticsSpec,
)
from campaigns.spec.training import (
    DistillationSpec as DistillationSpec,
)
from campaigns.spec.training import (
    DistributedEnvSpec as DistributedEnvSpec,
)
from campaigns.spec.training import (
    OnPolicySpec as OnPolicySpec,
)
from campaigns.spec.training import (
    ProfilerScheduleSpec as ProfilerScheduleSpec,
)
from campaigns.spec.training import (
    ProfilingSpec as ProfilingSpec,
)
from campaigns.spec.training import (
    TrainingSpec as TrainingSpec,
)

TEACHER_FORMS = ("mapping", "list")  # the two ways to write `teacher:` (a validation error's location names the form)


def _teacher_form(v) -> str:
    return "list" if isinstance(v, list | tuple) else "mapping"


class CampaignSpec(_Strict):
    """One distillation / fine-tune campaign."""

    name: Annotated[str, Field(description="Slug: lowercase letters, digits, underscores; the asset key prefix.")]
    description: str = Field("", description="Free text shown in the UI.")
    teacher: Annotated[
        Annotated[TeacherSpec, Tag("mapping")] | Annotated[list[TeacherEntry], Tag("list")],
        Discriminator(_teacher_form),
    ] = Field(
        description="The model that writes the answers the student learns from; or a list of teachers, each answering "
        "the prompts of its `categories` (data.category_field) with its own backend, price and budget share, one "
        'entry without `categories` answering the rest (docs/teacher.md, "Several teachers").'
    )
    student: StudentSpec
    data: DataSpec
    training: TrainingSpec
    dataset: DatasetSpec = DatasetSpec()
    evaluation: EvaluationSpec
    cost: CostSpec = CostSpec()
    schedule: ScheduleSpec | None = None
    kubernetes: KubernetesSpec | None = Field(
        None, description="Cluster settings for `training.launcher: k8s` (image, namespace, GPUs, volumes, secrets)."
    )
    automation: AutomationSpec = Field(
        default_factory=AutomationSpec,
        description="Sensors and automation that re-run the campaign (all off by default).",
    )
    sweep: SweepSpec | None = Field(
        None,
        description="A hyperparameter sweep before training (Optuna successive halving under a dollar cap; "
        "docs/sweeps.md); its best configuration drives student_adapter.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Experiment tracking (MLflow); off by default."
    )
    execution: ExecutionSpec = Field(
        default_factory=ExecutionSpec,
        description="Where the generation stages run: one process (default) or shards "
        "on a Ray cluster (docs/scaleout.md).",
    )

    _project_dir: Path | None = PrivateAttr(None)

    def set_project_dir(self, path: Path) -> None:
        """Set by the loader: the project the campaign file belongs to (``campaigns.paths``)."""
        self._project_dir = Path(path)

    @property
    def project_dir(self) -> Path:
        """What the campaign's relative paths are relative to (default: the project directory)."""
        return self._project_dir or paths.project_dir()

    # ------------------------------------------------------------------ teachers
    @property
    def several_teachers(self) -> bool:
        """``teacher:`` is a list (routed by category); a single teacher's campaign keeps its keys as before."""
        return isinstance(self.teacher, TeacherList)

    @property
    def teachers(self) -> tuple[TeacherEntry, ...]:
        """Every teacher with its name and categories, in the file's order; a single teacher is one entry named
        ``teacher`` that answers every prompt."""
        if isinstance(self.teacher, TeacherList):
            return self.teacher.entries
        return (TeacherEntry.model_validate(self.teacher.model_dump() | {"name": SINGLE_NAME}),)

    def teacher_named(self, name: str) -> TeacherEntry:
        for e in self.teachers:
            if e.name == name:
                return e
        raise KeyError(f"campaign {self.name} has no teacher {name!r}; its teachers: {[e.name for e in self.teachers]}")

    def teacher_for(self, category: str | None) -> TeacherEntry:
        """The teacher that answers a prompt of ``category``."""
        if isinstance(self.teacher, TeacherList):
            return self.teacher.for_category(category)
        return self.teachers[0]

    def for_teacher(self, entry: TeacherEntry | str) -> CampaignSpec:
        """The campaign as one of its teachers sees it: ``teacher`` is that teacher's plain section, so everything
        that asks, caches and prices one teacher serves each of several (the campaign itself with one teacher)."""
        if not isinstance(self.teacher, TeacherList):
            return self
        e = self.teacher_named(entry) if isinstance(entry, str) else entry
        return self.model_copy(update={"teacher": e.section()})

    @field_validator("teacher", mode="after")
    @classmethod
    def _teacher_list(cls, v):
        return TeacherList.of(v) if isinstance(v, list) else v

    @field_serializer("teacher", mode="wrap")
    def _teacher_as_written(self, v, handler, info):
        if not isinstance(v, TeacherList):
            return handler(v)
        how = {
            "mode": info.mode,
            "by_alias": bool(info.by_alias),
            "exclude_unset": info.exclude_unset,
            "exclude_defaults": info.exclude_defaults,
            "exclude_none": info.exclude_none,
        }
        return [e.model_dump(**how) for e in v.entries]

    def path(self, p: str | Path) -> Path:
        """A path from the campaign file (data source, suite, catalog, local model) as an absolute path."""
        return paths.resolve(p, self.project_dir)

    def with_params(self, params: dict) -> CampaignSpec:
        """This campaign with sweep parameters applied (``{"training.learning_rate": 1e-3, ...}``), validated."""
        from campaigns.spec.sweep import set_field

        doc = self.model_dump()
        for name, value in params.items():
            doc = set_field(doc, name, value)
        out = CampaignSpec.model_validate(doc)
        out._project_dir = self._project_dir
        return out

    def param_value(self, dotted: str):
        node = self
        for part in dotted.split("."):
            node = getattr(node, part)
        return node

    @model_validator(mode="after")
    def _sweep_fits_campaign(self) -> CampaignSpec:
        sw = self.sweep
        if sw is None:
            return self
        from pydantic import ValidationError

        from campaigns.spec.sweep import set_field

        max_steps = self.training.max_steps
        if max_steps is None:
            raise ValueError("sweep needs training.max_steps (its top rung); `epochs` is not supported with a sweep")
        if sw.rungs.min_steps >= max_steps:
            raise ValueError(
                f"sweep.rungs.min_steps ({sw.rungs.min_steps}) must be below training.max_steps "
                f"({max_steps}), the top rung: with no lower rung nothing is ever pruned"
            )
        sections = {"training": TrainingSpec, "training.distillation": DistillationSpec, "student.lora": LoraSpec}
        for name, _p in sw.space.items():
            section, _, field = name.rpartition(".")
            model = sections[section]
            if field not in model.model_fields:
                raise ValueError(
                    f"sweep.space.{name}: unknown field; {section} has {', '.join(sorted(model.model_fields))}"
                )
        base = self.model_dump()
        points = [("sweep.space." + n, {n: v}) for n, p in sw.space.items() for v in p.values_to_check()]
        points += [(f"sweep.enqueue[{i}]", pt) for i, pt in enumerate(sw.enqueue)]
        for where, pt in points:
            doc = base
            for n, v in pt.items():
                doc = set_field(doc, n, v)
            try:
                CampaignSpec.model_validate(doc | {"sweep": None})
            except ValidationError as e:
                errs = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
                raise ValueError(f"{where}: the campaign refuses {pt}: {errs}") from None
        return self

    @model_validator(mode="after")
    def _training_hardware_is_named(self) -> CampaignSpec:
        if self.training.hardware is None:
            raise ValueError(
                "training.hardware is required: the pricing-catalog key of the device training runs on "
                "(e.g. cpu-2vcpu, h100-sxm); training and local evaluation are billed at it"
            )
        return self

    @model_validator(mode="after")
    def _no_budget_over_unknown_spend(self) -> CampaignSpec:
        c = self.cost
        covered = [f"cost.budget_usd ({c.budget_usd})"] if c.budget_usd is not None else []
        covered += [
            f"cost.stage_budgets_usd.{s}"
            for s in ("teacher_generations", "evaluation")
            if s in c.stage_budgets_usd and (s == "teacher_generations" or self.evaluation.score_teacher)
        ]
        unpriced = [(i, e) for i, e in enumerate(self.teachers) if e.unpriced]
        if unpriced and covered:
            i, e = unpriced[0]
            where = f"teacher[{i}].price ({e.name})" if self.several_teachers else "teacher.price"
            raise ValueError(
                f"{where} is `unpriced`, so its spend is unknown and {' and '.join(covered)} cannot be kept: "
                "price the teacher (a catalog entry, or your own catalog with its real price, even 0 for a server you "
                "already pay for) or remove the budget"
            )
        return self

    @model_validator(mode="after")
    def _logit_distillation_needs_logprobs(self) -> CampaignSpec:
        if self.training.distillation.loss != "logits":
            return self
        if not self.several_teachers and self.teacher.sampling.logprobs is None:
            raise ValueError(
                "training.distillation.loss 'logits' needs the teacher's top-k log-probabilities: "
                "set teacher.sampling.logprobs (e.g. 8)"
            )
        for i, e in enumerate(self.teachers if self.several_teachers else ()):
            if e.sampling.logprobs is None:
                raise FieldValueError(
                    ("teacher", i, "sampling"),
                    f"training.distillation.loss 'logits' needs every teacher's top-k log-probabilities; teacher "
                    f"{e.name} has none: set its sampling.logprobs (e.g. 8)",
                )
        return self

    @model_validator(mode="after")
    def _several_teachers_fit(self) -> CampaignSpec:
        """What a list of teachers cannot do (yet), refused here with the field to change."""
        if not self.several_teachers:
            return self
        d = self.training.distillation
        if d.loss == "on_policy":
            raise FieldValueError(
                ("training", "distillation", "loss"),
                "'on_policy' scores the student's samples with one teacher inside training, and `teacher:` is a list "
                "(a teacher per category): on-policy scoring is not routed by category yet. Write `loss: sequence` "
                "or `loss: logits` (each teacher answers its own categories), or keep one teacher (a `teacher:` "
                "mapping) for on-policy distillation",
            )
        if d.teacher_tokenizer:
            raise FieldValueError(
                ("training", "distillation", "teacher_tokenizer"),
                "names one tokenizer, but `teacher:` is a list: each local teacher's tokenizer is its own model's "
                "and an API teacher's rows carry their tokens' text: remove `teacher_tokenizer`",
            )
        c = self.cost
        base = c.stage_budgets_usd.get("teacher_generations", c.budget_usd)
        for i, e in enumerate(self.teachers):
            if e.budget_share is not None and base is None:
                raise FieldValueError(
                    ("teacher", i, "budget_share"),
                    f"teacher {e.name}'s budget_share is a share of the teacher budget, but the campaign has none: "
                    "set cost.stage_budgets_usd.teacher_generations (or cost.budget_usd), or remove budget_share",
                )
        return self

    @model_validator(mode="after")
    def _on_policy_has_a_scorer(self) -> CampaignSpec:
        d = self.training.distillation
        if d.loss != "on_policy" or self.several_teachers:  # several teachers: refused by _several_teachers_fit
            return self
        if self.teacher.backend == "vllm":
            raise ValueError(
                "training.distillation.loss 'on_policy' needs a teacher that scores the student's samples during "
                "training: teacher.backend 'transformers' (in process, beside the student) or 'openai' (a server that "
                "returns prompt_logprobs, e.g. `vllm serve`); the offline 'vllm' backend only generates"
            )
        if self.sweep is not None:
            raise ValueError(
                "training.distillation.loss 'on_policy' does not run under a `sweep` yet (its trials train "
                "on the tokenized dataset only, without the student's samples and the teacher's scores): "
                "remove `sweep`, or sweep with loss 'sequence' or 'logits'"
            )
        return self

    @model_validator(mode="after")
    def _dora_is_one_process_only(self) -> CampaignSpec:
        if self.student.lora.use_dora and self.training.world_size > 1:
            raise ValueError(
                f"student.lora.use_dora with training.nodes × processes_per_node = {self.training.world_size}: DoRA's "
                f"weight norm reads the LoRA weights outside FSDP2's all-gather, and its backward fails (\"setStorage: "
                f'... out of bounds for storage of size 0", PEFT 0.21, torch 2.13); train DoRA in one process or use '
                f"plain LoRA (use_dora: false)"
            )
        return self

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not SLUG.match(v):
            raise ValueError(
                f"must be a slug (lowercase letter first, then lowercase letters, digits or '_', at most 63), got {v!r}"
            )
        return v

    @model_validator(mode="after")
    def _kuberay_needs_cluster(self) -> CampaignSpec:
        if self.execution.kuberay is not None and self.kubernetes is None:
            raise ValueError(
                "execution.kuberay runs the generation stages on Kubernetes but the campaign has no `kubernetes:` "
                "section; add at least `kubernetes: {image: <image with the project and ray>, namespace: <namespace>}` "
                "(its namespace, image, volumes and secrets are the Ray pods'; see docs/scaleout.md)"
            )
        return self

    @model_validator(mode="after")
    def _k8s_launcher_needs_cluster(self) -> CampaignSpec:
        if self.training.launcher == "k8s" and self.kubernetes is None:
            raise ValueError(
                "training.launcher is 'k8s' but the campaign has no `kubernetes:` section; add at least"
                " `kubernetes: {image: <trainer image>, namespace: <namespace>}` (see campaigns/examples/cluster.yaml)"
            )
        if self.kubernetes is not None:
            where = {n: "kubernetes.env" for n in self.kubernetes.env}
            where.update({x.name: "kubernetes.secret_env" for x in self.kubernetes.secret_env})
            clash = sorted(n for n in self.training.distributed_env.env() if n in where)
            if clash:
                raise ValueError(
                    "environment variables set twice: "
                    + ", ".join(f"{n} (training.distributed_env and {where[n]})" for n in clash)
                    + "; set each in one place: keep it under training.distributed_env (validated, exported to every"
                    " rank by the local and the k8s launcher) and remove it from the kubernetes section"
                )
        return self
