"""The pipeline's part of the mesh estimate: the bubble of each schedule, the saved
activations each pipeline rank holds at its peak, the memory per rank beside them, and the
`gradsync plan --estimate` lines; hand-computed on small numbers."""

from __future__ import annotations

import pytest

from gradsync import ConfigError
from gradsync._plan.estimate import MeshCluster, estimate_mesh, format_mesh
from gradsync._plan.estimate._pipeline import Schedule
from gradsync.cli import main


def test_the_bubble_of_each_schedule_by_hand():
    # P = 4, M = 8: the fill and drain take P - 1 = 3 part-slots of M + P - 1 = 11.
    assert Schedule(4, "GPipe", 8).bubble() == pytest.approx(3 / 11)
    assert Schedule(4, "1F1B", 8).bubble() == pytest.approx(3 / 11)
    assert Schedule(4, "1F1B").bubble() == pytest.approx(3 / 7), "M defaults to P"
    # Interleaved, V = 2: a part-slot is half as long, (P-1)/(V*M+P-1) = 3/19.
    assert Schedule(4, "Interleaved1F1B", 8, 2).bubble() == pytest.approx(3 / 19)
    assert Schedule(1).bubble() == 0.0


def test_the_parts_each_rank_holds_at_its_peak_by_hand():
    assert Schedule(4, "GPipe", 8).held_by_rank() == [8, 8, 8, 8], "every forward first"
    assert Schedule(4, "1F1B", 8).held_by_rank() == [4, 3, 2, 1], "P - stage"
    assert Schedule(4, "1F1B", 4).held_by_rank() == [4, 3, 2, 1]
    # Interleaved, P = 2, V = 2, M = 4: 2 rounds of 2 parts. Rank 0 runs (V-1) x 2 + 2 = 4
    # forwards before its first backward, then one more: 5 stage-parts of 1/2 each = 2.5;
    # rank 1: 2 forwards, then one more: 3 halves = 1.5.
    assert Schedule(2, "Interleaved1F1B", 4, 2).held_by_rank() == [2.5, 1.5]
    # M = P = 2, V = 2: rank 0's warm-up is capped at all V x M = 4 stage-parts: 2 parts.
    assert Schedule(2, "Interleaved1F1B", 2, 2).held_by_rank() == [2.0, 1.5]


def test_the_interleaved_count_follows_torchs_op_order():
    """The held parts equal the peak of forwards minus backwards in the op list torch's
    Interleaved1F1B computes for each rank (pure Python, no process group)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from types import SimpleNamespace

    kind = schedules._ComputationType
    for p, v, m in [(2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3), (3, 2, 6), (4, 2, 8), (4, 3, 4)]:
        rounds = max(1, m // p)
        fake = SimpleNamespace(
            n_local_stages=v,
            pp_group_size=p,
            _n_microbatches=m,
            number_of_rounds=rounds,
            microbatches_per_round=m // rounds,
        )
        for rank in range(p):
            ops = schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank)
            held = peak = 0
            for op in (o for o in ops if o is not None):
                held += {kind.FORWARD: 1, kind.FULL_BACKWARD: -1}.get(op.computation_type, 0)
                peak = max(peak, held)
            got = Schedule(p, "Interleaved1F1B", m, v).parts_held(rank) * v
            assert got == peak, (p, v, m, rank)


def _rows(**kw):
    base = {"grad_bytes": 1200.0, "param_bytes": 1200.0, "pp": 2, "dp_shard": 3, "k": 4}
    base.update(kw)
    cluster = MeshCluster(**base)
    return cluster, {row.policy: row for row in estimate_mesh(cluster)}


def test_memory_per_rank_and_step_time_with_a_pipeline_by_hand():
    # pp 2: a stage holds 600 B of gradients and parameters, 200 B per rank after dp_shard 3;
    # 150 elements of 4 B, 8 B of optimizer state each: 1200 B... per stage 150 / 3 = 50
    # elements per rank x 8 = 400 B. GPipe, M = 4: the first stage holds 4 parts x 100 B.
    cluster, rows = _rows(
        pp_schedule="GPipe",
        pp_microbatches=4,
        pp_saved_activation_bytes=100.0,
        optimizer_state_bytes=8.0,
        compute_ms=8.0,
    )
    every, defer = rows["every_step"], rows["defer"]
    assert (every.activation_memory, every.optimizer_memory) == pytest.approx((400.0, 400.0))
    assert defer.activation_memory == pytest.approx(400.0), "the same under every policy"
    # The bubble (P-1)/(M+P-1) = 1/5: a stage busy 8 ms per micro-step takes 10 ms; k = 4.
    assert every.step_ms == pytest.approx(4 * 10.0)
    assert cluster.activation_bytes(1) == pytest.approx(400.0), "GPipe: every stage holds M"
    # 1F1B: the first stage holds P = 2 parts, the second 1.
    cluster, rows = _rows(pp_microbatches=4, pp_saved_activation_bytes=100.0)
    assert rows["every_step"].activation_memory == pytest.approx(200.0)
    assert cluster.activation_bytes(1) == pytest.approx(100.0)
    assert _rows()[1]["every_step"].activation_memory is None, "unknown unless given"
    # Interleaved V = 2 sends (2V - 1) x A on two ranks: rank 0's two stages send forward,
    # its second stage sends back to rank 1's first.
    interleaved = _rows(
        pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, pp_activation_bytes=10.0
    )
    assert interleaved[1]["every_step"].pp_bytes == pytest.approx(4 * 3 * 10.0)


def test_format_names_the_bubble_and_the_memory_columns():
    cluster, _ = _rows(pp_schedule="GPipe", pp_microbatches=4, pp_saved_activation_bytes=100.0)
    text = format_mesh(cluster, estimate_mesh(cluster))
    assert "pp: GPipe, M=4 parts per micro-step: bubble (P-1)/(M+P-1) = 20.0 %" in text
    assert "parts per pipeline rank: 4, 4 x 100 B saved per part = 400 B on the first" in text
    every = next(line.split() for line in text.splitlines() if line.startswith("every_step"))
    # grads 200 B, params 200 B, optim 0 B, acts 400 B, memory/rank 800 B
    assert every[8:18] == ["200", "B", "200", "B", "0", "B", "400", "B", "800", "B"]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"pp_microbatches": 1}, "pp_microbatches=1 is fewer than the pp=2 stages"),
        ({"pp_stages_per_rank": 2}, "pp_stages_per_rank=2 needs pp_schedule='Interleaved1F1B'"),
        ({"pp_schedule": "Interleaved1F1B"}, "pp_stages_per_rank=1; give pp_stages_per_rank >= 2"),
        ({"pp_schedule": "ZeroBubble"}, "pp_schedule='ZeroBubble' is no schedule"),
        ({"pp_saved_activation_bytes": -1.0}, "pp_saved_activation_bytes=-1.0 must be >= 0"),
        ({"optimizer_state_bytes": -8.0}, "optimizer_state_bytes=-8.0 must be >= 0"),
        (
            {"pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 2, "pp_microbatches": 5},
            "pp_microbatches=5 is no multiple of its 2 rounds",
        ),
    ],
)
def test_bad_pipeline_input_is_one_line(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        _rows(**kw)
    assert "\n" not in str(err.value)


def test_plan_estimate_takes_the_schedule_flags(capsys):
    args = ["plan", "--gradient-accumulation-steps", "4", "--micro-batch-size", "4"]
    args += ["--nproc-per-node", "4", "--estimate", "--grad-bytes", "1200", "--latency-us", "0"]
    args += ["--compute-ms", "8", "--parallelism", "pp=2,dp_shard=2"]
    flags = ["--pp-schedule", "GPipe", "--pp-microbatches", "4"]
    assert main([*args, *flags, "--pp-saved-activation-bytes", "100"]) == 0
    out = capsys.readouterr().out
    assert "pp: GPipe, M=4 parts per micro-step: bubble (P-1)/(M+P-1) = 20.0 %" in out
    every = next(line.split() for line in out.splitlines() if line.startswith("every_step"))
    assert every[-2:] == ["40.0", "1.00x"], "k x 8 ms / (1 - 1/5)"
    assert every[14:16] == ["400", "B"], "the first stage holds 4 parts"
    assert main([*args, "--pp-stages-per-rank", "2"]) == 2
    assert "pp_stages_per_rank=2 needs pp_schedule='Interleaved1F1B'" in capsys.readouterr().err
