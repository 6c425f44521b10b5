"""The window state machine on its own."""

from __future__ import annotations

import pytest

from gradsync._plan.window import Window


def run(window: Window, batches: int, *, sized: bool = True) -> list[tuple[int, int, bool]]:
    out = []
    for i in range(batches):
        remaining = batches - i if sized else None
        step = window.begin(remaining=remaining, last=i == batches - 1)
        out.append((step.index, step.size, step.boundary))
        window.end()
    return out


def test_full_windows():
    assert run(Window(4), 8) == [(0, 4, False), (1, 4, False), (2, 4, False), (3, 4, True)] * 2


def test_partial_last_window_is_sized_by_what_remains():
    steps = run(Window(4), 6)
    assert steps[4:] == [(0, 2, False), (1, 2, True)]


def test_unsized_epoch_end_flushes_early():
    steps = run(Window(4), 6, sized=False)
    assert steps[-1] == (1, 2, True)  # the flush closes the window at the data's end


def test_k1_syncs_every_step():
    assert all(sync for _, _, sync in run(Window(1), 5))


def test_counting_without_a_dataloader():
    w = Window(3)
    flags = []
    for _ in range(7):
        flags.append(w.begin().boundary)
        w.end()
    assert flags == [False, False, True, False, False, True, False]


def test_step_change_applies_at_the_next_window():
    w = Window(4)
    w.begin()
    w.end()
    w.steps = 2
    assert w.steps == 2
    sizes = []
    for _ in range(5):
        sizes.append(w.begin().size)
        w.end()
    assert sizes == [4, 4, 4, 2, 2]


def test_nested_begin_is_an_error():
    w = Window(2)
    w.begin()
    with pytest.raises(RuntimeError, match="entered again"):
        w.begin()


@pytest.mark.parametrize("bad", [0, -1, "x"])
def test_bad_steps(bad):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        Window(bad)
