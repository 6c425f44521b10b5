"""Token-weighted accumulation on real 2-rank groups: DDP, FSDP2 and DeepSpeed ZeRO 2 give the
parameters of one process that takes, per global window, the token-mean cross-entropy over
all of the window's tokens; metrics across ranks; a frozen reference model on every backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness import Scenario, Shared
from harness.checks import max_diff
from scenarios.common import to_lists

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
causal_lm = pytest.importorskip("causal_lm")
preference = pytest.importorskip("preference")
pytest.importorskip("transformers")

from scenarios import tokens  # noqa: E402  (it imports the examples above)

SAMPLES, LR = 44, 0.05
LM = {
    **{
        f"{b}_{r}": Scenario(tokens.lm, backend=b, reduction=r)
        for b in ("ddp", "fsdp", "deepspeed")
        for r in ("sum", "normalized")
    },
    "ddp_mean": Scenario(tokens.lm, backend="ddp", reduction="mean"),
    "ddp_sum_k4_to_3": Scenario(tokens.lm, backend="ddp", reduction="sum", change_steps_at=(2, 3)),
    "fsdp_sum_every_step": Scenario(
        tokens.lm, backend="fsdp", reduction="sum", sync_policy="every_step"
    ),
    "deepspeed_sum_defer": Scenario(
        tokens.lm, backend="deepspeed", reduction="sum", sync_policy="defer"
    ),
    **{
        f"deepspeed{s}_sum": Scenario(tokens.lm, backend="deepspeed", reduction="sum", stage=s)
        for s in (0, 1, 3)
    },
}
SCENARIOS = {
    **LM,
    "metrics": Scenario(tokens.metrics),
    **{f"dpo_{b}": Scenario(tokens.dpo, backend=b) for b in ("ddp", "fsdp", "deepspeed")},
    "misuse": Scenario(tokens.misuse),
}
TOKEN_WEIGHTED = [n for n in LM if not n.endswith("mean")]


SHARED = Shared("gloo2", SCENARIOS, env={"DS_ACCELERATOR": "cpu"}, requires=("deepspeed",))


@pytest.fixture(scope="module")
def results(shared):
    pytest.importorskip("deepspeed")
    return shared(SHARED)


def token_reference(ranks):
    """One process: per global window, the cross-entropy summed over all of the window's
    tokens (every micro-batch of every rank) divided by their number; one SGD step."""
    data = causal_lm.Sequences(SAMPLES)
    model = causal_lm.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    counts, means = [], []
    for w in range(len(ranks[0]["windows"])):
        ids = [i for r in ranks for mb in r["windows"][w] for i in mb]
        opt.zero_grad()
        total = torch.zeros(())
        tokens = 0
        for i in ids:
            seq = data[i]["input_ids"].unsqueeze(0)
            logits = model(input_ids=seq).logits
            total = total + F.cross_entropy(logits[0, :-1], seq[0, 1:], reduction="sum")
            tokens += seq.shape[1] - 1
        (total / tokens).backward()
        opt.step()
        counts.append(tokens)
        means.append(float(total.detach()) / tokens)
    return {"state": to_lists(model.state_dict()), "items": counts, "means": means}


@pytest.mark.parametrize("name", TOKEN_WEIGHTED)
def test_update_is_the_global_token_mean(results, name):
    ranks = results[name]
    ref = token_reference(ranks)
    for r in ranks:
        assert r["optimizer_steps"] == len(r["windows"]) > 0
        common = {k: r["state"][k] for k in ref["state"]}
        assert max_diff(common, ref["state"]) < 1e-5
        assert r["items"] == ref["items"], "window_items must equal the window's token count"
        assert r["logged"] == pytest.approx(ref["means"], rel=1e-5), (
            "the logged loss is the global token mean"
        )


def test_windows_include_the_partial_last_one_and_a_change_of_k(results):
    sizes = [len(w) for w in results["ddp_sum"][0]["windows"]]
    assert sizes == [4, 4, 3] * 2
    changed = [len(w) for w in results["ddp_sum_k4_to_3"][0]["windows"]]
    assert changed == [4, 4, 3, 3, 3, 3, 2]


def test_mean_of_micro_batch_means_differs_from_the_token_mean(results):
    ranks = results["ddp_mean"]
    ref = token_reference(ranks)
    common = {k: ranks[0]["state"][k] for k in ref["state"]}
    assert max_diff(common, ref["state"]) > 1e-4


@pytest.mark.parametrize("name", ["ddp_sum", "fsdp_sum", "deepspeed_sum_defer"])
def test_the_count_all_reduce_is_reported_apart_from_gradient_reductions(results, name):
    for r in results[name]:
        # Each window's first micro-step starts the item count's all-reduce and its boundary
        # the window loss's: gradsync's own, apart from the gradient reductions.
        position = 0
        for rec in r["audit"]:
            own = (position == 0) + bool(rec["boundary"])
            assert rec["own"] == ({"allreduce": own} if own else {}), rec
            position = 0 if rec["boundary"] else position + 1
        off = [rec for rec in r["audit"] if not rec["boundary"]]
        assert off and all(rec["reductions"] == 0 for rec in off), "deferral stays provable"


def test_gather_for_metrics_sees_each_sample_once_in_order(results):
    for r in results["metrics"]:
        assert r["for_metrics"] == list(range(45))
        assert len(r["plain"]) == 46  # the sampler padded one sample in; plain gather keeps it


def test_reduce_gather_and_pad_agree_with_one_process(results):
    r0, r1 = results["metrics"]
    for r in (r0, r1):
        assert r["gather"]["a"] == [0.0, 10.0, 11.0]  # rank 0 holds 1 row, rank 1 holds 2
        assert r["gather"]["b"][0] == [1.0, 2.0]
        assert r["gather"]["b"][1] == [[0.0] * 3] * 2 + [[1.0] * 3] * 2
        assert r["sum"] == {"a_total": 21.0, "b0": 3.0, "b0_mean": 1.5}
        assert r["local_main"] == (r["order"] == 0)
    assert r0["padded"] == [[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]]
    assert r1["padded"] == [[2.0, 2.0]] * 3


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "deepspeed"])
def test_dpo_with_a_frozen_reference_model(results, backend):
    ranks = results[f"dpo_{backend}"]
    for r in ranks:
        assert r["optimizer_steps"] == len(r["windows"]) == 3
        for window in r["windows"]:
            for micro in window:  # rows (pair, role): both answers of each pair, together
                pairs = {}
                for pair, role in micro:
                    pairs.setdefault(pair, []).append(role)
                assert all(sorted(roles) == [0, 1] for roles in pairs.values()), micro
    seen = [pair for r in ranks for w in r["windows"] for mb in w for pair, role in mb if role == 0]
    assert sorted(seen) == list(range(SAMPLES)), "each pair on exactly one rank"
    assert ranks[0]["wrapped"] != "DistributedDataParallel"
    ref = dpo_reference(ranks)
    for r in ranks:
        assert max_diff(r["policy"], ref) < 1e-5


def dpo_reference(ranks):
    """One process on the same windows: the mean over the window's micro-batches of each
    micro-batch's mean DPO loss."""
    import copy

    data = preference.PreferencePairs(SAMPLES)
    policy = preference.make_model()
    reference = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    for w in range(len(ranks[0]["windows"])):
        micro = [
            sorted({p for p, _ in mb}, key=[p for p, _ in mb].index)
            for r in ranks
            for mb in r["windows"][w]
        ]
        opt.zero_grad()
        loss = sum(
            preference.dpo_loss(policy, reference, preference.collate_pairs([data[i] for i in mb]))
            for mb in micro
        ) / len(micro)
        loss.backward()
        opt.step()
    return to_lists(policy.state_dict())


def test_a_count_that_fails_on_one_rank_fails_on_every_rank(results):
    errors = [r["negative_on_one_rank"] for r in results["misuse"]]
    assert errors[1].startswith("ConfigError: count_items returned -1 for batch 0 of epoch 0")
    assert "count_items failed on 1 other rank(s)" in errors[0]


def test_deepspeed_refuses_a_second_trained_model(results):
    for r in results["misuse"]:
        assert r["second_trained"].startswith("ConfigError: backend='deepspeed' trains one model")


def test_the_self_check_stays_silent(results):
    """Every loop here is a correct one: the deferral self-check must not warn."""
    assert "gradsync self-check" not in results.log
