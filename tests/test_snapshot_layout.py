"""A snapshot whose state changed shape: a tensor of another dtype or shape
under the same path, metadata grown past its reserve. Each gets a new layout
and reads back exactly, in line and in the background."""

from __future__ import annotations

import pytest
import torch

from trainguard.adapters.torch.snapshot import Snapshots, read_payload
from trainguard.core.snapshot import SnapshotDir


@pytest.fixture
def snaps(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    directory = SnapshotDir.create("job", root)
    snaps = Snapshots(directory, 0, count=2)
    yield snaps
    snaps.close()
    directory.remove()


def _state(w: torch.Tensor, moment: torch.Tensor, records: list) -> dict:
    return {"state": {"model": {"w": w, "b": torch.arange(7.0)},
                      "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": moment}},
                                    "param_groups": [{"lr": 0.01, "params": [0]}]}, "step": 1},
            "history": {"records": records, "pids": {"0": [1]}}}


def _read_back(snaps: Snapshots, step: int) -> dict:
    snaps.settle()
    (index,) = [i for i, held in snaps.held.items() if held == step]
    slot = snaps.slots[index]
    slot.lock(False, block=True)
    try:
        got, state = read_payload(slot.payload())
    finally:
        slot.unlock()
    assert got == step
    return state


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("background", [False, True])
def test_a_tensor_that_changes_dtype_or_shape_under_its_path_gets_a_new_layout(snaps, background):
    g = torch.Generator().manual_seed(0)
    w, moment = torch.randn(30, 70, generator=g), torch.randn(30, 70, generator=g)
    states = [_state(w, moment, []),
              _state(w.reshape(70, 30), moment, []),  # the same bytes in another shape
              _state(w.reshape(70, 30), moment.bfloat16(), []),  # another dtype, fewer bytes
              _state(torch.randn(3, 5, generator=g), moment.bfloat16(), [])]  # fewer elements
    layouts = []
    for step, state in enumerate(states, 1):
        assert snaps.take(state, step, background=background) is not None
        assert _same(_read_back(snaps, step), state), step
        layouts.append(snaps.layout)
    assert len({id(x) for x in layouts}) == 4, "each change of a dtype or shape makes a new layout"
    assert snaps.taken == 4 and not snaps.errors


@pytest.mark.parametrize("background", [False, True])
def test_metadata_grown_past_its_reserve_is_written_again_in_a_new_layout(snaps, background):
    g = torch.Generator().manual_seed(1)
    w, moment = torch.randn(30, 70, generator=g), torch.randn(30, 70, generator=g)
    small = _state(w, moment, [])
    assert snaps.take(small, 1, background=background) is not None
    first = snaps.layout
    records = [{"strategy": "retry", "step": i, "reason": "a long reason " * 4} for i in range(200)]
    grown = _state(w, moment, records)  # the same tensors; the history outgrows the header's reserve
    assert snaps.take(grown, 2, background=background) is not None
    assert snaps.layout is not first and snaps.layout.header_bytes > 2 * first.header_bytes
    back = _read_back(snaps, 2)
    assert _same(back, grown) and back["history"]["records"] == records
    assert _same(_read_back(snaps, 1), small), "the older snapshot stays intact"
    assert snaps.taken == 2 and not snaps.errors


def _many(n: int, step: int, **change) -> dict:
    """A state of ``n`` tensors, values of ``step``."""
    model = {f"layer{i}.weight": torch.full((i % 7 + 1, 3), float(step * 1000 + i)) for i in range(n)}
    model.update(change)
    return {"state": {"model": model, "step": step}, "history": {"records": [], "pids": {}}}


def test_a_change_deep_in_a_large_state_ends_in_a_new_layout(snaps):
    """A state of many tensors whose layout stood for some takes: a tensor
    of another shape near its end, then one tensor more, each ends in a new
    layout with every value right."""
    for step in (1, 2, 3):
        state = _many(150, step)
        assert snaps.take(state, step) is not None
        assert _same(_read_back(snaps, step), state), step
    settled = snaps.layout
    changes = [{"layer140.weight": torch.full((2, 2), 7.0)},  # another shape in the last batch
               {"layer140.weight": torch.full((2, 2), 7.0), "extra": torch.arange(4.0)}]  # and one tensor more
    for step, change in enumerate(changes, 4):
        state = _many(150, step, **change)
        assert snaps.take(state, step) is not None
        assert _same(_read_back(snaps, step), state), step
    assert snaps.layout is not settled and snaps.taken == 5 and not snaps.errors


def test_a_value_a_snapshot_cannot_carry_is_named_and_the_next_take_is_whole(snaps):
    for step in (1, 2):
        assert snaps.take(_many(150, step), step) is not None
    bad = _many(150, 3)
    bad["state"]["model"]["layer149.weight"] = {1, 2}
    with pytest.raises(TypeError, match="cannot carry a set at .state.model.layer149.weight"):
        snaps.take(bad, 3)
    state = _many(150, 4)
    assert snaps.take(state, 4) is not None
    assert _same(_read_back(snaps, 4), state) and _same(_read_back(snaps, 2), _many(150, 2))
