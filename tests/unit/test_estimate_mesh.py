"""The estimate on a (dp_replicate, dp_shard, tp) mesh: bytes per dimension and memory per rank
per policy, hand-computed on small numbers; what auto picks for a budget; the --parallelism
text and `gradsync plan --parallelism`."""

from __future__ import annotations

import pytest

from gradsync import ConfigError
from gradsync._plan.estimate import (
    HybridCluster,
    MeshCluster,
    auto_policy,
    estimate_hybrid,
    estimate_mesh,
    format_mesh,
)
from gradsync.cli import main
from gradsync.mesh import parse


def _rows(**kw):
    base = {
        "grad_bytes": 1200.0,
        "param_bytes": 1200.0,
        "dp_replicate": 2,
        "dp_shard": 3,
        "tp": 2,
        "k": 4,
    }
    base.update(kw)
    return {row.policy: row for row in estimate_mesh(MeshCluster(**base))}


def test_two_replicas_three_shards_two_tp_ranks_by_hand():
    # Per TP rank: G_T = P_T = 1200 / 2 = 600; per rank after dp_shard: 200.
    # Reduce-scatter and all-gather send (S-1)/S x 600 = 400; the all-reduce of the 200-byte
    # shard across 2 replicas sends 2 x 1/2 x 200 = 200.
    rows = _rows()
    assert list(rows) == ["every_step", "defer_replicate", "defer", "defer + params"]
    # Kept parameters: the gathered copy (600) beside the shard (200); auto weighs what it holds.
    expected = {  # shard bytes, replicate bytes, grads, params, extra, what auto weighs
        "every_step": (4 * 400 + 8 * 400, 4 * 200, 200, 200, 0, 0),
        "defer_replicate": (4 * 400 + 8 * 400, 200, 200, 200, 0, 200),
        "defer": (400 + 8 * 400, 200, 600, 200, 400, 400),
        "defer + params": (400 + 400, 200, 600, 200 + 600, 400 + 600, 400 + 600),
    }
    for policy, (shard, replicate, grads, params, extra, weighs) in expected.items():
        row = rows[policy]
        got = (
            row.shard_bytes,
            row.replicate_bytes,
            row.grad_memory,
            row.param_memory,
            row.extra_memory,
            row.deferral_bytes,
        )
        assert got == pytest.approx((shard, replicate, grads, params, extra, weighs)), policy
        assert row.tp_bytes is None, "TP traffic is model-dependent unless given"


def test_a_tp_share_below_one_keeps_the_rest_whole_on_every_tp_rank():
    # Half the model sharded over T = 4, half replicated: G_T = 1000 x (0.5/4 + 0.5) = 625.
    rows = _rows(
        grad_bytes=1000.0, param_bytes=1000.0, dp_replicate=1, dp_shard=5, tp=4, tp_share=0.5
    )
    assert "defer_replicate" not in rows  # one replica: nothing to defer across
    assert rows["every_step"].grad_memory == pytest.approx(125)
    assert rows["defer"].grad_memory == pytest.approx(625)
    assert rows["defer"].deferral_bytes == pytest.approx(500)
    assert rows["defer"].replicate_bytes == 0
    assert rows["every_step"].shard_bytes == pytest.approx(4 * 500 + 8 * 500)  # (S-1)/S x 625 = 500


def test_given_tp_bytes_count_k_times_under_every_policy_and_no_tp_sends_nothing():
    rows = _rows(tp_bytes=10.0)
    assert {row.tp_bytes for row in rows.values()} == {40.0}
    assert {row.tp_bytes for row in _rows(tp=1).values()} == {0.0}


def test_without_tp_the_rows_are_the_hsdp_estimate():
    rows = _rows(tp=1, dp_replicate=4, dp_shard=2, k=8)
    hybrid = estimate_hybrid(
        HybridCluster(grad_bytes=1200.0, param_bytes=1200.0, replicas=4, shards=2, k=8)
    )
    for h in hybrid:
        assert rows[h.policy].shard_bytes == pytest.approx(h.intra_bytes)
        assert rows[h.policy].replicate_bytes == pytest.approx(h.cross_bytes)
        assert rows[h.policy].grad_memory == pytest.approx(h.grad_memory)


@pytest.mark.parametrize(
    ("budget", "replicas", "policy"),
    [
        (1000, 2, "defer + params"),
        (999, 2, "defer"),
        (400, 2, "defer"),
        (399, 2, "defer_replicate"),
        (200, 2, "defer_replicate"),
        (199, 2, "every_step"),
        (399, 1, "every_step"),
    ],
)
def test_auto_takes_the_deepest_deferral_that_fits_the_budget(budget, replicas, policy):
    rows = list(_rows(dp_replicate=replicas).values())
    assert auto_policy(rows, budget, replicas) == policy


def test_auto_weighs_what_the_window_holds():
    # defer + params holds 1000 beyond every_step's (the gathered 600 beside the shard): a budget
    # of 900 does not take it, one of 1000 does
    def chosen(budget: float) -> str:
        cluster = MeshCluster(
            1200.0, 1200.0, dp_replicate=2, dp_shard=3, tp=2, k=4, budget_bytes=budget
        )
        return format_mesh(cluster, estimate_mesh(cluster))

    assert chosen(900.0).endswith("auto with a budget of 900 B per rank -> defer")
    assert chosen(1000.0).endswith("auto with a budget of 1.00 KB per rank -> defer + params")
    for row in estimate_mesh(MeshCluster(1200.0, 1200.0, dp_replicate=2, dp_shard=3, tp=2, k=4)):
        assert row.extra_memory <= row.deferral_bytes, row.policy


def test_a_tp_group_that_would_span_nodes_is_refused():
    with pytest.raises(ConfigError, match="tp=3 does not divide the 8 processes per node"):
        _rows(tp=3, per_node=8)
    with pytest.raises(ConfigError, match="dp_shard=0 must be an integer >= 1"):
        _rows(dp_shard=0)
    with pytest.raises(ConfigError, match="tp_share=1.5"):
        _rows(tp_share=1.5)


@pytest.mark.parametrize(
    ("text", "world", "mesh"),
    [
        ("dp_replicate=2,dp_shard=2,tp=2", 8, (2, 2, 2)),
        ("dp_shard=-1,tp=2", 8, (1, 4, 2)),
        ("tp=4, dp_replicate=-1", 16, (4, 1, 4)),
        ("dp_shard=8", 8, (1, 8, 1)),
    ],
)
def test_the_parallelism_text(text, world, mesh):
    assert parse(text, "--parallelism").resolve(world, "--parallelism").shape == mesh


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("dp_shard=3,tp=2", "holds 1 x 3 x 2 x 1 = 6 processes, but the world has 8"),
        ("pp=2", "pp"),
        ("tp=two", "tp='two' is not a whole number"),
        ("dp_shard=-1,tp=-1", "-1"),
        ("tp=0", "tp=0"),
        ("dp_shard=-1,tp=3", "3 does not divide the world of 8"),
    ],
)
def test_bad_parallelism_text_names_the_value_and_the_fix(text, match):
    with pytest.raises(ConfigError, match=match):
        parse(text, "--parallelism").resolve(8, "--parallelism")


def test_plan_parallelism_counts_data_parallel_ranks_and_prints_the_mesh_rows(capsys):
    code = main(
        [
            "plan",
            "--gradient-accumulation-steps",
            "4",
            "--micro-batch-size",
            "2",
            "--nproc-per-node",
            "8",
            "--estimate",
            "--grad-bytes",
            "1200",
            "--latency-us",
            "0",
            "--compute-ms",
            "0",
            "--parallelism",
            "dp_replicate=2,dp_shard=2,tp=2",
            "--memory-budget",
            "500",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert (
        "data-parallel processes: 4 of 8 (1 node(s) x 8), mesh dp_replicate=2,dp_shard=2,tp=2"
        in out
    )
    assert "global batch size:       32 per optimizer step" in out  # 2 x 4 x (2 x 2)
    assert "mesh dp_replicate=2 x dp_shard=2 x tp=2 (8 ranks), k=4" in out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split() and line.split()[0] in ("every_step", "defer_replicate")
    }
    # G_T = 600, S = 2: every_step reduce-scatters 4 x 300 and all-gathers 8 x 300 in dp_shard
    assert rows["every_step"][1:3] == ["3.60", "KB"]
    assert rows["defer_replicate"][3:5] == [
        "300",
        "B",
    ]  # one all-reduce of the 300-byte shard: 2 x 1/2 x 300
    assert "auto with a budget of 500 B per rank -> defer\n" in out + "\n"
    assert "ddp " not in out and "HSDP" not in out


def test_plan_refuses_parallelism_with_fsdp_mesh(capsys):
    code = main(
        [
            "plan",
            "--gradient-accumulation-steps",
            "4",
            "--nproc-per-node",
            "4",
            "--estimate",
            "--grad-bytes",
            "1200",
            "--latency-us",
            "0",
            "--compute-ms",
            "0",
            "--parallelism",
            "dp_shard=2,tp=2",
            "--fsdp-mesh",
            "2,2",
        ]
    )
    assert code == 2 and "give one (--fsdp-mesh R,S is --parallelism" in capsys.readouterr().err


def test_a_pipeline_divides_the_bytes_per_rank_and_adds_its_own_traffic():
    # pp 2: each stage holds half the model; per TP rank of a stage G_T = 1200 / 2 / 2 = 300,
    # per rank after dp_shard 100; reduce-scatter and all-gather send 2/3 x 300 = 200.
    rows = _rows(pp=2, pp_activation_bytes=1000.0)
    every, defer = rows["every_step"], rows["defer"]
    assert (every.shard_bytes, every.replicate_bytes) == pytest.approx((4 * 200 + 8 * 200, 4 * 100))
    assert (every.grad_memory, defer.grad_memory, every.param_memory) == pytest.approx(
        (100, 300, 100)
    )
    # Two stages: each sends one direction (activations forward, or gradients back) per
    # micro-step; an inner stage of three sends both. The same under every policy.
    assert {row.pp_bytes for row in rows.values()} == {4 * 1000.0}
    assert {r.pp_bytes for r in _rows(pp=3, pp_activation_bytes=1000.0).values()} == {8000.0}
    assert {r.pp_bytes for r in _rows(pp=2).values()} == {None}, "unknown unless given"
    assert {r.pp_bytes for r in _rows().values()} == {0.0}, "no pipeline, no traffic"
    assert MeshCluster(1.0, 1.0, pp=2, dp_shard=3, tp=2).world == 12
    with pytest.raises(ConfigError, match="pp=0"):
        estimate_mesh(MeshCluster(1.0, 1.0, pp=0))


def test_plan_estimate_with_a_pipeline(capsys):
    args = ["plan", "--gradient-accumulation-steps", "4", "--micro-batch-size", "2"]
    args += ["--nproc-per-node", "8", "--estimate", "--grad-bytes", "1200", "--latency-us", "0"]
    args += ["--compute-ms", "0", "--parallelism", "pp=2,dp_shard=2,tp=2"]
    assert main([*args, "--pp-activation-bytes", "1000"]) == 0
    out = capsys.readouterr().out
    assert "data-parallel processes: 2 of 8 (1 node(s) x 8), mesh pp=2,dp_shard=2,tp=2" in out
    assert "mesh pp=2 x dp_replicate=1 x dp_shard=2 x tp=2 (8 ranks), k=4" in out
    assert "300 B per TP rank of a stage, 150 B per rank after dp_shard" in out
    every = next(line.split() for line in out.splitlines() if line.startswith("every_step"))
    assert every[6:8] == ["4.00", "KB"]  # pp/rank: k x 1000 B, one direction per stage
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "give --pp-activation-bytes per micro-step" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("every_step", "defer"))]
    # tp, pp, and the saved activations (--pp-saved-activation-bytes not given)
    assert len(rows) == 3 and all(row.count("model-dep.") == 3 for row in rows)
