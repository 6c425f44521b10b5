"""The HSDP rows of the communication estimate: bytes across nodes per policy (the figures of
an 8 B-parameter model on 16 nodes x 8 GPUs), gradient memory, the mesh flag and its errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gradsync import ConfigError
from gradsync._plan.estimate import (
    HYBRID_POLICIES,
    HybridCluster,
    MeshCluster,
    estimate_hybrid,
    estimate_mesh,
    hybrid_mesh,
)
from gradsync.cli import main

GB = 1e9


def _rows(**kw):
    base = {
        "grad_bytes": 8e9 * 4,
        "param_bytes": 8e9 * 2,
        "replicas": 16,
        "shards": 8,
        "k": 8,
        "intra_gbs": 476.0,
        "inter_gbs": 46.0,
        "per_node": 8,
    }
    base.update(kw)
    return {row.policy: row for row in estimate_hybrid(HybridCluster(**base))}


def test_eight_billion_parameters_on_16_by_8_cross_nodes_60_vs_7_5_gb_and_defer_holds_28_gb_more():
    rows = _rows()
    assert list(rows) == list(HYBRID_POLICIES)
    # the shard (32 GB / 8 = 4 GB) all-reduced across 16 replicas: 2 x 15/16 x 4 GB = 7.5 GB a call
    assert rows["every_step"].cross_bytes == pytest.approx(60 * GB)
    assert rows["defer_replicate"].cross_bytes == pytest.approx(7.5 * GB)
    assert rows["defer"].cross_bytes == pytest.approx(7.5 * GB)
    assert [rows[p].cross_allreduces for p in HYBRID_POLICIES] == [8, 1, 1, 1]
    # gradient memory: the sharded 4 GB (every_step), the partial buffer in its place
    # (defer_replicate), the unsharded 32 GB (defer): 28 GB more
    assert (
        rows["every_step"].grad_memory
        == rows["defer_replicate"].grad_memory
        == pytest.approx(4 * GB)
    )
    assert rows["defer_replicate"].extra_memory == 0
    assert rows["defer"].extra_memory == pytest.approx(28 * GB)
    assert rows["defer + params"].extra_memory == pytest.approx(
        28 * GB + 16 * GB
    )  # + P: the gathered copy


def test_inside_the_node_the_reduce_scatter_and_the_all_gathers_follow_the_ring():
    rows, r = _rows(), 7 / 8
    rs, ag = r * 32 * GB, r * 16 * GB
    assert rows["every_step"].intra_bytes == pytest.approx(8 * rs + 16 * ag)
    assert rows["defer_replicate"].intra_bytes == pytest.approx(8 * rs + 16 * ag)
    assert rows["defer"].intra_bytes == pytest.approx(rs + 16 * ag)
    assert rows["defer + params"].intra_bytes == pytest.approx(rs + ag)
    # time: bytes over each link's bandwidth (no latency here), compute 0
    row = rows["defer_replicate"]
    assert row.comm_ms == pytest.approx((row.intra_bytes / 476e9 + row.cross_bytes / 46e9) * 1e3)
    assert row.speedup == pytest.approx(rows["every_step"].step_ms / row.step_ms)
    assert row.speedup > 1


def test_shards_that_cross_nodes_count_as_cross_node_traffic():
    rows = _rows(shards=16, replicas=8)  # 16 shards on 8-GPU nodes
    assert rows["defer"].intra_bytes == 0
    assert rows["defer"].cross_bytes > 2 * (7 / 8) * (32 * GB / 16)


def test_one_replica_or_one_shard_sends_nothing_there():
    assert all(r.cross_bytes == 0 and r.cross_allreduces == 0 for r in _rows(replicas=1).values())
    assert all(r.intra_bytes == 0 for r in _rows(shards=1).values())


@pytest.mark.parametrize(
    ("text", "mesh"), [("16,8", (16, 8)), ("-1,8", (16, 8)), ("16,-1", (16, 8)), ("node", (16, 8))]
)
def test_the_mesh_reads_like_fsdp_mesh(text, mesh):
    assert hybrid_mesh(text, 128, 8) == mesh


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("3,8", "does not fit 128 ranks"),
        ("-1,-1", "two positive"),
        ("0,128", "two positive"),
        ("2x64", "give R,S"),
        ("-1,3", "does not fit"),
    ],
)
def test_a_bad_mesh_names_the_value_and_the_fix(text, match):
    with pytest.raises(ConfigError, match=match):
        hybrid_mesh(text, 128, 8)


def test_plan_estimate_prints_the_hsdp_rows(capsys):
    code = main(
        [
            "plan",
            "--gradient-accumulation-steps",
            "8",
            "--nproc-per-node",
            "8",
            "--nnodes",
            "16",
            "--estimate",
            "--params",
            "8e9",
            "--dtype-bytes",
            "4",
            "--param-dtype-bytes",
            "2",
            "--latency-us",
            "25",
            "--compute-ms",
            "1000",
            "--fsdp-mesh",
            "16,8",
            "--estimate-backends",
            "hsdp",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "HSDP on a 16 x 8 mesh" in out and "46 GB/s across nodes" in out  # the defaults
    lines = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split()
        and line.split()[0] in ("every_step", "defer_replicate", "defer")
        and "+" not in line
    }
    assert lines["every_step"][3:5] == ["60.00", "GB"]
    assert lines["defer_replicate"][3:5] == ["7.50", "GB"]
    assert lines["defer"][8:10] == ["28.00", "GB"]
    assert "ddp " not in out  # only the backends asked for; --bandwidth not needed for them


def test_plan_estimate_adds_hsdp_to_the_other_backends_when_given_a_mesh(capsys):
    code = main(
        [
            "plan",
            "--gradient-accumulation-steps",
            "4",
            "--nproc-per-node",
            "8",
            "--nnodes",
            "2",
            "--estimate",
            "--params",
            "1e9",
            "--bandwidth",
            "46",
            "--latency-us",
            "25",
            "--compute-ms",
            "100",
            "--fsdp-mesh",
            "node",
            "--inter-bandwidth",
            "1.56",
        ]
    )
    out = capsys.readouterr().out
    assert (
        code == 0
        and "ddp " in out
        and "HSDP on a 2 x 8 mesh" in out
        and "1.56 GB/s across nodes" in out
    )
    code = main(
        [
            "plan",
            "--gradient-accumulation-steps",
            "4",
            "--nproc-per-node",
            "8",
            "--nnodes",
            "2",
            "--estimate",
            "--params",
            "1e9",
            "--latency-us",
            "25",
            "--compute-ms",
            "100",
            "--fsdp-mesh",
            "3,8",
            "--estimate-backends",
            "hsdp",
        ]
    )
    assert code == 2 and "--fsdp-mesh='3,8' does not fit 16 ranks" in capsys.readouterr().err


BENCH = Path(__file__).resolve().parents[2] / "docs" / "img" / "hsdp_bytes.json"


def test_the_estimate_matches_the_bytes_the_4_rank_benchmark_measured():
    """benchmarks/hsdp_bytes.py on a (2, 2) mesh (docs/img/hsdp_bytes.json): per optimizer
    step, the replicate group's all-reduce payload sent as a ring (2(R-1)/R x payload) is the
    estimate's cross-node bytes, and the shard group reduce-scatters the gradients as often
    as the estimate says, for every policy and k."""
    result = json.loads(BENCH.read_text())
    hybrid = [c for c in result["cells"] if c["mesh"] == [2, 2]]
    assert {(c["k"], c["asked"]) for c in hybrid} == {
        (k, p)
        for k in (4, 8)
        for p in ("every_step", "defer_replicate", "defer", "defer + params", "auto")
    }
    for cell in hybrid:
        (r, s), k, g = cell["mesh"], cell["k"], cell["grad_bytes"]
        est = {
            row.policy: row
            for row in estimate_hybrid(
                HybridCluster(grad_bytes=g, param_bytes=g, replicas=r, shards=s, k=k, per_node=s)
            )
        }[cell["policy"]]
        for window in cell["windows"]:
            shard, replicate = window["groups"]["shard"], window["groups"]["replicate"]
            assert 2 * (r - 1) / r * replicate["reduction_bytes"] == pytest.approx(est.cross_bytes)
            reduce_scatters = k if cell["policy"] in ("every_step", "defer_replicate") else 1
            assert shard["reduction_bytes"] == pytest.approx(reduce_scatters * g)  # the RS input: G
            if cell["policy"] != "every_step":
                assert window["replicate_allreduces_off_boundary"] == 0


def test_the_memory_a_deferred_window_holds_is_the_estimates():
    """The same run's memory column (docs/img/hsdp_bytes.json, the three meshes; on the
    (dp_shard 2, tp 2) mesh G and P are a TP rank's share, G_T and P_T): before its
    boundary a ``defer`` window holds the unsharded gradients G, one that keeps the
    parameters gathered G + P (the gathered copy beside the shard), within 1 MiB on every
    rank; ``every_step`` and ``defer_replicate`` hold their G/S, plus at most one FSDP unit's
    reduce buffers (4 MiB) not yet freed."""
    sys.path.insert(0, str(BENCH.parents[2] / "benchmarks"))
    from hsdp_bytes import estimated_held

    cells = json.loads(BENCH.read_text())["cells"]
    assert {tuple(c["mesh"]) for c in cells} == {(2, 2), (1, 4), (1, 2, 2)}
    unit = 1024 * 1025 * 4  # a block: Linear(1024, 1024), fp32
    for cell in cells:
        held, expected = cell["memory"]["held_bytes"], estimated_held(cell)
        assert len(held) == 4, cell["asked"]
        if cell["policy"].startswith("defer") and cell["policy"] != "defer_replicate":
            assert all(abs(h - expected) < 2**20 for h in held), (
                cell["mesh"],
                cell["k"],
                cell["asked"],
                held,
            )
        else:
            assert all(expected - 2**20 < h < expected + unit + 2**20 for h in held), (
                cell["asked"],
                held,
            )
    by = {(tuple(c["mesh"]), c["k"], c["asked"]): c for c in cells}
    mib = 2**20
    kept = by[((2, 2), 4, "defer + params")]["memory"]
    assert (
        kept["predicted_extra_bytes"] == 8429600 + 16859200
    )  # G - G/2 + P: auto weighs the gathered copy whole
    assert min(kept["held_bytes"]) > 32 * mib  # G + P = 32.2 MiB
    # what the window holds beyond every_step's shard (G/2) is what the adapter predicted
    assert all(abs(h - 8429600 - kept["predicted_extra_bytes"]) < mib for h in kept["held_bytes"])


def test_the_estimate_matches_the_tensor_parallel_mesh_the_benchmark_measured():
    """benchmarks/hsdp_bytes.py on (dp_shard 2, tp 2) (docs/img/hsdp_bytes.json): per optimizer
    step the dp_shard bytes a rank sends ((S-1)/S x the reduce-scatters' input, (S-1) x the
    all-gathers' input shard) are ``estimate_mesh``'s with the plan's tp_share; the TP
    all-reduces (2(T-1)/T x the tensor) are k x one micro-step's under every policy; the
    adapter's count of a TP rank's gradients is the estimate's G_T; dp_shard reductions wait
    for the boundary where the policy defers."""
    cells = [c for c in json.loads(BENCH.read_text())["cells"] if c["mesh"] == [1, 2, 2]]
    assert {(c["k"], c["asked"]) for c in cells} == {
        (k, p) for k in (4, 8) for p in ("every_step", "defer", "defer + params", "auto")
    }
    s, t = 2, 2
    for cell in cells:
        k, g = cell["k"], cell["grad_bytes"]
        micro = 2 * (t - 1) / t * cell["micro_tp"]["allreduce"]
        cluster = MeshCluster(
            g, g, dp_shard=s, tp=t, k=k, tp_share=cell["tp_share"], tp_bytes=micro
        )
        est = {row.policy: row for row in estimate_mesh(cluster)}[cell["policy"]]
        assert cluster.per_tp_rank(g) == pytest.approx(cell["held_grad_bytes"])
        for window in cell["windows"]:
            shard, tp = window["groups"]["shard"], window["groups"]["tp"]
            gathered = shard["bytes"] - shard["reduction_bytes"]
            sent = (s - 1) / s * shard["reduction_bytes"] + (s - 1) * gathered
            assert sent == pytest.approx(est.shard_bytes), (k, cell["asked"])
            assert 2 * (t - 1) / t * tp["bytes"] == pytest.approx(est.tp_bytes), (k, cell["asked"])
            assert tp["ops"] == {"allreduce": 3 * k}  # 2 rowwise outputs, 1 colwise input gradient
            deferred = cell["policy"] != "every_step"
            assert window["shard_reduce_scatters_off_boundary"] == (0 if deferred else 4 * (k - 1))
