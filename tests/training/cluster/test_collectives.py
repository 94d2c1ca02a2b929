"""Collective bandwidth figures (nccl-tests' algbw/busbw) and the all-reduce smoke, really run with
gloo across two "nodes" on this CPU. The sweep itself runs across two processes in
tests/test_cluster_ladder.py (through Dagster, with its baseline)."""

import json

import pytest

from training.cluster import collectives
from training.cluster.smoke import gradients_equal
from training.cluster.torchrun import run_torchrun


@pytest.mark.parametrize("n,ar,ag", [(1, 0.0, 0.0), (2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)])
def test_bus_bandwidth_factors_are_nccl_tests(n, ar, ag):
    assert collectives.bus_factor("all_reduce", n) == ar
    assert collectives.bus_factor("all_gather", n) == ag
    assert collectives.bus_factor("reduce_scatter", n) == ag
    row = collectives.row_for("all_reduce", 1 << 30, 0.5, n)  # 1 GiB in 0.5 s
    assert row["algbw_gbps"] == pytest.approx(2 * (1 << 30) / 1e9)
    assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * ar)


def test_sizes_and_parsing():
    assert collectives.message_sizes(8, 64) == [8, 16, 32, 64]
    assert collectives.parse_bytes("16M") == 16 << 20 and collectives.parse_bytes("8") == 8
    assert collectives.parse_bytes("1.5K") == 1536
    with pytest.raises(ValueError, match="byte size"):
        collectives.parse_bytes("lots")
    with pytest.raises(ValueError, match="unknown collective"):
        collectives.bus_factor("broadcast_all", 2)
    # all_gather / reduce_scatter sizes count the whole buffer: n ranks x the per-rank part
    assert collectives.per_rank_elements("all_gather", 8, 2) == 1
    assert collectives.per_rank_elements("all_reduce", 8, 2) == 2


@pytest.mark.slow
def test_allreduce_smoke_across_two_nodes(tmp_path):
    out = tmp_path / "grads.json"
    run_torchrun(
        ["-m", "training.cluster.smoke", "allreduce", "--out", str(out)],
        nodes=2,
        procs=1,
        log_dir=tmp_path,
        timeout_s=300,
    )
    result = json.loads(out.read_text())
    ok, why = gradients_equal(result)
    assert ok, why
    assert result["world_size"] == 2 and result["ranks_agree"]
    broken = result | {"avg_max_abs_diff": 0.5}
    ok, why = gradients_equal(broken)
    assert not ok and "AVG all-reduce differs" in why
