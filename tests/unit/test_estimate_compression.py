"""The estimate under ``comm_hook``: the payload of one gradient reduction per hook (torch's
PowerSGD layout: P and Q per weight worth compressing, 1-D tensors whole), the rows it changes
on each backend and mesh dimension, and ``gradsync plan --estimate --comm-hook``'s output and
refusals. tests/multiprocess/test_comm_hook.py checks the same payloads against the audit of a
2-rank gloo run."""

from __future__ import annotations

import pytest

from gradsync import ConfigError
from gradsync._plan.estimate import (
    Cluster,
    HybridCluster,
    MeshCluster,
    estimate,
    estimate_hybrid,
    estimate_mesh,
)
from gradsync._plan.estimate.compression import Compression, parse_shapes
from gradsync.cli import main

#: a 1024 x 256 weight, its bias, a 1 x 256 head (not worth compressing at any rank), a conv
SHAPES = ((1024, 256), (1024,), (1, 256), (64, 32, 3, 3))


def _payload(**kw) -> float:
    c = Compression(shapes=SHAPES, **kw)
    return c.payload(4.0 * c.numel, 4.0, 25 * 2**20)


def test_half_precision_hooks_send_two_bytes_an_element():
    assert Compression("fp16").payload(4000.0, 4.0, 2**20) == 2000.0
    assert Compression("bf16").payload(4000.0, 4.0, 2**20) == 2000.0
    assert Compression("bf16").payload(2000.0, 2.0, 2**20) == 2000.0  # bf16 gradients already
    assert Compression().payload(4000.0, 4.0, 2**20) == 4000.0


@pytest.mark.parametrize("rank", [1, 4])
def test_power_sgd_sends_p_and_q_per_weight_and_the_rest_whole(rank):
    # weight: (1024 + 256) r; bias 1024 and head 256 whole; conv viewed as 64 x 288: (64 + 288) r
    expected = 4 * ((1024 + 256) * rank + 1024 + 256 + (64 + 288) * rank)
    assert _payload(hook="power_sgd", rank=rank) == expected
    assert _payload(hook="power_sgd", rank=rank, wrapper="fp16") == expected / 2


def test_power_sgd_keeps_a_matrix_whole_where_compression_saves_too_little():
    # 8 x 8 at rank 2: (8 + 8) x 2 x min_compression_rate 2 = 64, not < 64: sent whole
    c = Compression("power_sgd", rank=2, shapes=((8, 8),))
    assert c.payload(256.0, 4.0, 2**20) == 256.0
    loose = Compression("power_sgd", rank=2, min_compression_rate=1.0, shapes=((8, 8),))
    assert loose.payload(256.0, 4.0, 2**20) == 4 * 32
    capped = Compression("power_sgd", rank=50, shapes=((400, 3),))  # r' = min(n, m, r) = 3
    assert capped.payload(4800.0, 4.0, 2**20) == 4800.0  # (403) x 3 x 2 > 1200: whole


def test_batched_power_sgd_sends_two_square_sides_per_bucket():
    # 10_000 elements in buckets of 4_000: sides 64, 64, 45
    c = Compression("batched_power_sgd", rank=1)
    assert c.payload(40_000.0, 4.0, 16_000.0) == 4 * 2 * (64 + 64 + 45)


def test_the_ddp_rows_carry_the_hook_and_the_others_the_reduce_dtype():
    g = 4e9
    base = {"grad_bytes": g, "param_bytes": g, "world": 8, "k": 8, "bandwidth_gbs": 100.0}
    base |= {"latency_us": 0.0, "compute_ms": 1.0, "bucket_bytes": g}
    plain = {f"{r.backend}/{r.mode}": r for r in estimate(Cluster(**base))}
    half = {
        f"{r.backend}/{r.mode}": r
        for r in estimate(Cluster(**base, compression=Compression("fp16")))
    }
    assert half["ddp/defer"].sent_bytes == plain["ddp/defer"].sent_bytes / 2
    assert half["ddp/defer"].payload_bytes == g / 2 and plain["ddp/defer"].payload_bytes == g
    assert half["ddp/naive (every_step)"].payload_bytes == 8 * g / 2
    # FSDP2: the reduce-scatter halves, the all-gathers of the parameters do not
    r = 7 / 8
    assert half["fsdp/defer"].sent_bytes == pytest.approx(2 * 8 * r * g + r * g / 2)
    power = Compression("power_sgd", rank=4, shapes=((1000, 1000),))
    rows = estimate(Cluster(**{**base, "grad_bytes": 4e6}, compression=power))
    assert {row.backend for row in rows} == {"ddp"}  # PowerSGD runs on DDP only
    assert rows[1].payload_bytes == 4 * 2000 * 4


def test_hsdp_and_mesh_halve_the_gradient_reductions_on_both_dimensions():
    g = 8e9
    plain = estimate_hybrid(HybridCluster(g, g, replicas=2, shards=4, k=4))
    half = estimate_hybrid(
        HybridCluster(g, g, replicas=2, shards=4, k=4, compression=Compression("bf16"))
    )
    for p, h in zip(plain, half):
        assert h.cross_bytes == p.cross_bytes / 2  # the all-reduce of the shard
        gathers = {"every_step": 8, "defer_replicate": 8, "defer": 8, "defer + params": 1}
        ag = gathers[p.policy] * 3 / 4 * g
        assert h.intra_bytes - ag == pytest.approx((p.intra_bytes - ag) / 2)
    mesh = estimate_mesh(
        MeshCluster(g, g, dp_replicate=2, dp_shard=4, k=4, compression=Compression("fp16"))
    )
    assert [m.replicate_bytes for m in mesh] == [h.cross_bytes for h in half]
    with pytest.raises(ConfigError, match="runs on ddp only"):
        estimate_mesh(
            MeshCluster(g, g, dp_shard=4, compression=Compression("power_sgd", shapes=((4, 4),)))
        )


def test_shapes_read_from_text_and_refused_in_one_line():
    assert parse_shapes("4x3*2, 5") == ((4, 3), (4, 3), (5,))
    with pytest.raises(ConfigError, match=r"'4xq' is no shape"):
        parse_shapes("4xq")
    with pytest.raises(ConfigError, match="give the model's gradient shapes"):
        Compression("power_sgd").check()


ARGS = ["plan", "--nproc-per-node", "8", "--nnodes", "2", "--gradient-accumulation-steps", "8"]
ARGS += ["--estimate", "--bandwidth", "46", "--latency-us", "20", "--compute-ms", "100"]


def test_plan_estimate_prints_the_compressed_bytes(capsys):
    code = main([*ARGS, "--shapes", "4096x4096*16,4096*8", "--comm-hook", "power_sgd",
                 "--comm-state-option", '{"matrix_approximation_rank": 4}'])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    payload = 4 * (16 * 8192 * 4 + 8 * 4096)  # 2.23 MB
    assert (
        f"comm_hook=power_sgd (rank 4): one gradient reduction hands {payload / 1e6:.2f} MB" in out
    )
    assert "it runs on ddp only" in out and "fsdp " not in out
    defer = next(line for line in out.splitlines() if line.startswith("ddp      defer"))
    assert defer.endswith(f"{payload / 1e6:.2f} MB")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--params", "1e9", "--comm-hook", "powersgd"], "(did you mean power_sgd?)"),
        (["--params", "1e9", "--comm-hook", "power_sgd"], "give the model's gradient shapes"),
        (["--params", "1e9", "--comm-hook", "fp16", "--comm-wrapper", "fp16"], "no PowerSGD hook"),
        (
            ["--shapes", "8x8", "--comm-hook", "power_sgd", "--parallelism", "dp_shard=16"],
            "runs on ddp only",
        ),
    ],
)
def test_plan_estimate_refuses_a_hook_in_one_line(capsys, extra, message):
    assert main([*ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gradsync: error: ") and message in err
