"""Pricing catalog and planner: dated prices, overrides, ZeRO/FSDP formulas against the reference
numbers, LoRA/QLoRA memory against hand counts, roofline time, and `campaign plan`."""

from __future__ import annotations

import pytest

from campaign_orchestrator.costs.catalog import PricingError, compute_line, read_catalog, token_lines, usage_lines
from campaign_orchestrator.costs.memory import ModelShape, training_memory, zero_model_state_bytes, zero_table
from campaign_orchestrator.costs.plan.roofline import generation_seconds
from campaigns.loader import parse_campaign_text

CATALOG = """
version: "2026-02-01"
entries:
  gpu-x:
    unit: gpu-hour
    memory_gb: 80
    perf: {peak_tflops: 100, memory_bandwidth_gbps: 1000, decode_step_overhead_s: 0.01, generate_startup_s: 5}
    prices:
      - {as_of: "2025-01-01", usd: 3.0, spot_usd: 1.5, source: "old list price"}
      - {as_of: "2026-01-01", usd: 2.0, spot_usd: 1.0, source: "new list price"}
  api-x:
    unit: million-tokens
    input_usd: 1.0
    output_usd: 4.0
    batch_discount: 0.5
    as_of: "2026-01-01"
    source: "provider page"
"""


@pytest.fixture
def catalog_file(tmp_path):
    p = tmp_path / "catalog.yaml"
    p.write_text(CATALOG)
    return p


def test_dated_prices_pick_the_latest_on_or_before_the_date(catalog_file):
    assert read_catalog(catalog_file, on="2025-06-30").get("gpu-x").usd == 3.0
    new = read_catalog(catalog_file, on="2026-06-30").get("gpu-x")
    assert (new.usd, new.spot_usd, new.source, new.catalog_version) == (2.0, 1.0, "new list price", "2026-02-01")
    with pytest.raises(PricingError, match="no price dated on or before 2024-01-01"):
        read_catalog(catalog_file, on="2024-01-01").get("gpu-x")


def test_overrides_version_pin_and_bad_entries(catalog_file, tmp_path):
    c = read_catalog(
        catalog_file, {"gpu-x": 9.0, "api-x": {"output_usd": 2.0, "source": "our contract"}}, on="2026-06-30"
    )
    assert c.get("gpu-x").usd == 9.0 and c.get("api-x").output_usd == 2.0 and c.get("api-x").input_usd == 1.0
    assert c.get("api-x").source == "our contract"
    with pytest.raises(PricingError, match="no such entry"):
        read_catalog(catalog_file, {"nope": 1.0})
    with pytest.raises(PricingError, match="pins cost.catalog_version '2025-01-01'"):
        read_catalog(catalog_file, expect_version="2025-01-01")
    bad = tmp_path / "bad.yaml"
    bad.write_text('version: "1"\nentries:\n  g: {unit: gpu-hour, usd: 1.0, as_of: "2026-01-01"}\n')
    with pytest.raises(PricingError, match=r"entries.g needs `as_of` \(date\) and `source`"):
        read_catalog(bad)
    with pytest.raises(PricingError, match="no price entry 'h100'"):
        c.get("h100")


def test_lines_apply_tier_and_batch_discount(catalog_file):
    c = read_catalog(catalog_file, on="2026-06-30")
    on_demand = compute_line("training", c.get("gpu-x"), 1800, devices=4)
    spot = compute_line("training", c.get("gpu-x"), 1800, devices=4, tier="spot")
    assert (on_demand["quantity"], on_demand["usd"], spot["usd"]) == (2.0, 4.0, 2.0)
    assert on_demand["catalog_version"] == "2026-02-01" and spot["tier"] == "spot"
    full = token_lines("teacher", c.get("api-x"), 2_000_000, 500_000)
    batch = usage_lines("teacher", c.get("api-x"), 99.0, 2_000_000, 500_000, batch=True)
    assert [x["usd"] for x in full] == [2.0, 2.0] and [x["usd"] for x in batch] == [1.0, 1.0]


def test_shipped_catalog_is_valid_and_has_sources():
    from campaigns.paths import shipped_campaigns_dir

    c = read_catalog(shipped_campaigns_dir() / "pricing/catalog.yaml")
    assert {"cpu-2vcpu", "h100-sxm", "h200", "api-open-70b"} <= set(c.entries)
    assert all(e.source and e.as_of for e in c.entries.values())


def test_zero_formulas_reproduce_the_reference_numbers():
    psi, n = 7.5e9, 64
    got = [zero_model_state_bytes(psi, n, s) / 1e9 for s in (0, 1, 2, 3)]
    assert got == pytest.approx([120.0, 31.40625, 16.640625, 1.875], rel=1e-12)
    t = zero_table(psi, 64, 8)  # 8 nodes × 8 GPUs: hybrid shards inside a node of 8
    assert t["zero3_fsdp_full"] == pytest.approx(1.875) and t["fsdp_hybrid"] == pytest.approx(15.0)


DEMO_STUDENT = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "vocab_size": 32,
    "tie_word_embeddings": True,
}


def _spec(training: str = "", student: str = "") -> object:
    return parse_campaign_text(f"""
name: t
teacher: {{model: "@demo/teacher", hardware: cpu-2vcpu}}
student: {{base_model: "@demo/student"{student}}}
data: {{source: campaigns/data/demo/*.jsonl}}
training: {{max_steps: 10, micro_batch_size: 4, hardware: cpu-2vcpu{training}}}
evaluation: {{suites: [{{name: s}}]}}
""")


def test_lora_and_qlora_memory_match_hand_counts():
    shape = ModelShape.from_config(DEMO_STUDENT)
    # per layer: q,k,v,o 64×64 each; gate, up 64×192; down 192×64
    assert shape.linear_params == 2 * (4 * 64 * 64 + 3 * 64 * 192) == 106_496
    assert shape.params == 106_496 + 32 * 64 + 2 * 2 * 64 + 64 == 108_864
    # r=16 on all seven projections: the trainer reports 40,960 trainable parameters for the demo
    assert shape.lora_params(16, list(shape.module_dims())) == 40_960
    m = training_memory(shape, _spec(), seq_len=32)
    gb = m["per_device_gb"]
    assert gb["base_weights"] == pytest.approx((106_496 * (0.5 + 4 / 64) + 2368 * 2) / 1e9)
    assert gb["optimizer_states"] == pytest.approx(12 * 40_960 / 1e9)
    per_token_layer = 2 * (4 * 64 + 64 + 2 * 64 + 64 + 4 * 192) + 2 * 16 * 7
    assert gb["activations"] == pytest.approx(4 * 32 * 2 * per_token_layer / 1e9)
    assert gb["activations_checkpointed"] == pytest.approx((4 * 32 * 2 * 2 * 64 + 4 * 32 * per_token_layer) / 1e9)
    bf16 = training_memory(shape, _spec(student=", quantization: {load_in_4bit: false}"), seq_len=32)
    assert bf16["per_device_gb"]["base_weights"] == pytest.approx(108_864 * 2 / 1e9)


def test_cpu_heap_retention_is_a_fraction_of_activations_and_logits_in_the_total():
    shape = ModelShape.from_config(DEMO_STUDENT)
    none = training_memory(shape, _spec(), seq_len=32, compute_dtype="float32")
    kept = training_memory(shape, _spec(), seq_len=32, compute_dtype="float32", heap_retention=0.75)
    gb = kept["per_device_gb"]
    assert none["per_device_gb"]["heap_retained"] == 0
    assert gb["heap_retained"] == pytest.approx(0.75 * (gb["activations"] + gb["logits"]))
    assert kept["total_gb"] == pytest.approx(none["total_gb"] + gb["heap_retained"])
    assert kept["total_checkpointed_gb"] == pytest.approx(
        none["total_checkpointed_gb"] + 0.75 * (gb["activations_checkpointed"] + gb["logits"])
    )


def test_sharding_divides_the_states_by_the_shard_group():
    llama7b = {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 32000,
    }
    shape = ModelShape.from_config(llama7b)
    one = training_memory(shape, _spec(", processes_per_node: 1, sharding: none"), 2048)["per_device_gb"]
    full = training_memory(shape, _spec(", nodes: 2, processes_per_node: 8, sharding: full"), 2048)["per_device_gb"]
    hybrid = training_memory(shape, _spec(", nodes: 2, processes_per_node: 8, sharding: hybrid"), 2048)["per_device_gb"]
    assert full["base_weights"] == pytest.approx(one["base_weights"] / 16)
    assert hybrid["base_weights"] == pytest.approx(one["base_weights"] / 8)
    assert full["optimizer_states"] == pytest.approx(one["optimizer_states"] / 16)
    assert one["allgather_buffer"] == 0 and full["allgather_buffer"] > 0


def test_generation_roofline_by_hand(catalog_file):
    entry = read_catalog(catalog_file).get("gpu-x")
    # compute: 2·1e9·100·(10+20) / (100e12·0.5) = 0.12 s; memory: 10 batches·20 steps·2e9 B / 1e12 B/s = 0.4 s
    s = generation_seconds(int(1e9), 2e9, 100, 10, 20, 10, entry, 0.5)
    assert s == pytest.approx(0.4 + 200 * 0.01 + 5)
    # answers of 20 tokens on average, but each batch runs to its longest (the cap, 64): 10·64 decode steps,
    # compute 2·1e9·100·(10+64) / 50e12 = 0.296 s < memory 640·2e9 / 1e12 = 1.28 s
    s = generation_seconds(int(1e9), 2e9, 100, 10, 20, 10, entry, 0.5, decode_tokens=64)
    assert s == pytest.approx(1.28 + 640 * 0.01 + 5)


def test_campaign_plan_prints_memory_fit_and_costs(artifact_root, capsys):
    from campaign_app.cli import main

    assert main(["plan", "demo", "--artifacts", str(artifact_root)]) == 0
    out = capsys.readouterr().out
    for needle in (
        "base weights",
        "optimizer states (Adam, K=12)",
        "activations, checkpointed",
        "fits",
        "ZeRO-1",
        "teacher_generations",
        "student_adapter",
        "evaluation",
        "host-hour",
        "within budget",
    ):
        assert needle in out, needle
    assert "108,864 parameters" in out and "LoRA 40,960 trainable" in out


def test_the_heap_is_planned_for_the_allocator_the_launcher_will_start_training_on(monkeypatch):
    """Local launcher on a host with jemalloc: the catalog's jemalloc retention; without it, or on
    Kubernetes (whose launcher does not preload it), glibc's."""
    from campaign_orchestrator import allocator
    from campaign_orchestrator.costs.plan.fit import heap_retention
    from campaigns.paths import shipped_campaigns_dir

    entry = read_catalog(shipped_campaigns_dir() / "pricing/catalog.yaml").get("cpu-2vcpu")
    monkeypatch.setattr(allocator, "jemalloc_path", lambda *a: "/usr/lib/libjemalloc.so.2")
    assert heap_retention(entry, _spec()) == (entry.perf["heap_retention_jemalloc"], "jemalloc")
    local = _spec()
    k8s = local.model_copy(update={"training": local.training.model_copy(update={"launcher": "k8s"})})
    assert heap_retention(entry, k8s) == (entry.perf["heap_retention"], "glibc")
    monkeypatch.setenv(allocator.ENV, "glibc")
    assert heap_retention(entry, _spec()) == (entry.perf["heap_retention"], "glibc")
    monkeypatch.delenv(allocator.ENV)
    monkeypatch.setattr(allocator, "jemalloc_path", lambda *a: None)
    assert heap_retention(entry, _spec())[1] == "glibc"
    assert entry.perf["heap_retention_jemalloc"] < entry.perf["heap_retention"]


def test_only_sampled_local_requests_decode_to_the_longest_answer():
    from campaign_orchestrator.costs.plan.roofline import decode_length

    # greedy local requests run on the continuous engine and vLLM batches continuously: rows leave as they finish
    assert decode_length("transformers", 0.0, 64) is None
    assert decode_length("vllm", 0.8, 64) is None
    # sampled local requests run on generate: every row of a batch decodes until its longest answer ends
    assert decode_length("transformers", 0.8, 64) == 64


def test_a_teacher_over_the_base_weights_is_planned_only_for_its_context_items():
    """campaigns/smollm2.yaml: the teacher is the base's model and dtype with a few-shot context before plural
    items only, so its general answers are the base's (the generation cache) and cost the evaluation nothing."""
    from campaign_orchestrator.costs.plan.facts import suite_context_shares, suite_file_rows, teacher_answers_as_base
    from campaigns.loader import load_campaign_file
    from tests.support import REPO_ROOT

    spec = load_campaign_file(REPO_ROOT / "campaigns" / "smollm2.yaml")
    assert teacher_answers_as_base(spec)
    assert suite_context_shares(spec, [], suite_file_rows(spec)) == {"plurals": 1.0, "general": 0.0}
    other = spec.model_copy(update={"teacher": spec.teacher.model_copy(update={"compute_dtype": "float32"})})
    assert not teacher_answers_as_base(other)  # another dtype: another key, its own answers
    qlora = spec.model_copy(
        update={
            "student": spec.student.model_copy(
                update={"quantization": spec.student.quantization.model_copy(update={"load_in_4bit": True})}
            )
        }
    )
    assert not teacher_answers_as_base(qlora)  # a 4-bit base answers under its own key


def test_the_plan_is_typed_and_its_json_is_the_same_plan(artifact_root, capsys):
    """`campaign plan --json` prints the Plan dataclass as JSON: every stage's estimate with its own fields, the
    data facts by name (no string-keyed facts to misspell)."""
    import json

    from campaign_app.cli import main
    from campaign_orchestrator.costs.plan.facts import DataFacts
    from campaign_orchestrator.costs.plan.stages import EvaluationEstimate, TeacherEstimate, TrainingEstimate
    from campaigns.loader import load_campaign_file
    from campaigns.paths import shipped_campaigns_dir
    from stages.pricing import Pricing

    plan = Pricing().plan(load_campaign_file(shipped_campaigns_dir() / "demo.yaml"), artifact_root)
    assert isinstance(plan.data, DataFacts) and plan.data.train_prompts > 0
    st = plan.stages
    assert [type(st[k]) for k in ("teacher_generations", "student_adapter", "evaluation")] == [
        TeacherEstimate,
        TrainingEstimate,
        EvaluationEstimate,
    ]
    assert st["evaluation"].models == ["candidate", "base", "teacher"] and plan.total_usd == pytest.approx(
        sum(plan.stage_usd(k) for k in st)
    )
    assert main(["plan", "demo", "--artifacts", str(artifact_root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stages"]["student_adapter"]["steps"] == st["student_adapter"].steps
    assert doc["data"]["train_prompts"] == plan.data.train_prompts and doc["total_usd"] == pytest.approx(plan.total_usd)
    assert doc["campaign_spent_usd"] == 0.0
