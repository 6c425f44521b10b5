"""`gradsync verify` on an N-D mesh: a tensor-parallel MLP (two colwise/rowwise Linear pairs)
launched on 4 gloo ranks as (dp_shard 2, tp 2) against one process replaying the 2 data-parallel
ranks' micro-batches; two verifies, each one 4-rank launch and one single-process reference
(``gradsync.cli`` called in this process, as ``python -m gradsync`` calls it). The launched
ranks start as copies of the launcher (``--start-method fork``): the verdict is tested here,
not how a worker starts."""

from __future__ import annotations

import re

from harness.verify import ROOT, table

SCRIPT = ROOT / "tests" / "scripts" / "verify_tp.py"
LAUNCH = (
    "--parallelism",
    "dp_shard=2,tp=2",
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


def test_tp_on_dp_shard_equals_one_process_and_a_dp_rank_dependent_loss_differs(
    run_verify, tmp_path
):
    code, out = run_verify(*LAUNCH, "--verify-dir", tmp_path / "exact", SCRIPT)
    assert code == 0, out
    assert "with 4 process(es) (2 data-parallel)" in out, out
    assert "k=2 per process, 4 micro-batches per window" in out, out
    rows = table(out)
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert all(r[-1] == "ok" for r in rows), out
    assert max(float(r[4]) for r in rows) <= 1e-5, out
    # Under defer no gradient bytes leave a rank off the boundary; the TP collectives of every
    # micro-step are computation, not counted there.
    assert all(r[5] == "0" for r in rows), out
    log = (tmp_path / "exact" / "launched.log").read_text()
    assert re.search(r"tp \[3,3\] \(\d+", log), log  # the TP traffic ran, on its own line
    assert "micro-steps 1:" in log, log  # the last window is partial (5 micro-batches, k=2)

    code, out = run_verify(*LAUNCH, SCRIPT, "--dp-bug")
    assert code == 1, out
    rows = table(out)
    assert rows and rows[0][-1] == "DIFFERS", out
    assert float(rows[0][1]) > 1.2 * float(rows[0][2]), out  # the window loss says it at step 1
    assert "differs from one process from step 1 on" in out, out
