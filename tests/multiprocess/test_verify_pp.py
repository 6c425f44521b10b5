"""`gradsync verify` with a pipeline: an MLP cut into two stages, launched on 4 gloo ranks as
(pp 2, dp_shard 2) against one process replaying the 2 data-parallel ranks' micro-batches
(the reference runs the same `pipeline_step` loop without a pipeline); each rank holds one
stage, so the snapshots are the stages' parameters gathered, and the window loss is the last
stage's. Two verifies, each one 4-rank launch (``--start-method fork``) and one reference."""

from __future__ import annotations

from harness.verify import ROOT, table

SCRIPT = ROOT / "tests" / "scripts" / "verify_pp.py"
LAUNCH = (
    "--parallelism",
    "pp=2,dp_shard=2",
    "--nproc-per-node",
    "4",
    "--backend",
    "fsdp",
    "--sync-policy",
    "defer",
    "--gradient-accumulation-steps",
    "2",
    "--steps",
    "3",
    "--start-method",
    "fork",
)


def test_a_pipeline_equals_one_process_and_a_dp_rank_dependent_loss_differs(run_verify, tmp_path):
    code, out = run_verify(*LAUNCH, "--verify-dir", tmp_path / "exact", SCRIPT)
    assert code == 0, out
    assert "with 4 process(es) (2 data-parallel)" in out, out
    assert "k=2 per process, 4 micro-batches per window" in out, out
    rows = table(out)
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert all(r[-1] == "ok" for r in rows), out
    assert all(r[1] == r[2] for r in rows), out  # the last stage's window loss, shown
    assert max(float(r[4]) for r in rows) <= 1e-5, out
    assert all(r[5] == "0" for r in rows), out  # defer: no gradient byte off the boundary

    code, out = run_verify(*LAUNCH, SCRIPT, "--dp-bug")
    assert code == 1, out
    rows = table(out)
    assert rows and rows[0][-1] == "DIFFERS", out
    assert "differs from one process from step 1 on" in out, out
