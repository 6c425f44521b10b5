"""torch.compile with gradsync in one process: compiled before prepare, compiled after it, and
``Accelerator(compile=True)`` (on DDP and FSDP2: multiprocess/test_compile.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradsync import Accelerator

from harness.checks import max_diff
from scenarios.common import Net, make_model, to_lists

WHERE = ("before", "after", "option")


@pytest.mark.parametrize("where", WHERE)
def test_compiled_on_one_process(clean_env, where):
    accel = Accelerator(
        backend="single", gradient_accumulation_steps=2, seed=0, compile=where == "option"
    )
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accel.prepare(torch.compile(model) if where == "before" else model, opt)
    if where == "after":
        model = torch.compile(model)
    batches = [(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(4)]
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for w in range(2):
        ref_opt.zero_grad()
        (sum(F.mse_loss(ref(x), y) for x, y in batches[2 * w : 2 * w + 2]) / 2).backward()
        ref_opt.step()
    for x, y in batches:
        with accel.accumulate(model):
            accel.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    assert isinstance(accel.unwrap_model(model), Net)
    state = accel.get_state_dict(model)
    assert sorted(state) == sorted(ref.state_dict())
    assert max_diff(to_lists(state), to_lists(ref.state_dict())) < 1e-6
