"""The GradScaler carried whole, and state the loop uses but did not give
the Guard (issue 37), in one process.

A retry rolls host objects back to the last commit. ``GradScaler.state_dict()``
has no per-optimizer stage: loading it left the stage a failed update had
set, and the step after the retry raised "unscale_() has already been
called" (or, without ``unscale_``, skipped the unscaling).
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from torch.amp.grad_scaler import OptState
from torch.utils.data import DataLoader, TensorDataset

from trainguard.adapters.torch.optimizer import GuardedOptimizer
from trainguard.adapters.torch.own import pack, unpack
from trainguard.adapters.torch.scaler import ScalerState
from trainguard.adapters.torch.trainstate import TrainState
from trainguard.adapters.torch.undeclared import Undeclared


def _model_and_scaler(init_scale: float = 2.0 ** 16):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2)


def _backward(model, scaler, value: float = 1.0) -> None:
    loss = model(torch.full((3, 4), value)).sum()
    scaler.scale(loss).backward()


def test_a_rollback_inside_the_update_lets_the_retried_step_unscale_again():
    model, opt, scaler = _model_and_scaler()
    state = TrainState(model, opt, scaler=scaler)
    faults = [RuntimeError("UCE ERROR: injected at the end of the update")]

    def end_of_update():
        if faults:
            raise faults.pop()

    wrapped = GuardedOptimizer(opt, lambda: None, end_of_update)  # what the Guard's injector does
    faults_at_step_2 = faults.pop()
    _backward(model, scaler)
    scaler.unscale_(wrapped)
    scaler.step(wrapped)
    scaler.update()
    state.commit(1)
    faults.append(faults_at_step_2)
    opt.zero_grad()
    _backward(model, scaler)
    scaler.unscale_(wrapped)
    with pytest.raises(RuntimeError, match="UCE"):
        scaler.step(wrapped)  # step 2 fails inside the update: after the optimizer's step, before update()
    state.restore_host()  # the retry's rollback
    opt.zero_grad()
    _backward(model, scaler)
    scaler.unscale_(wrapped)  # raised "unscale_() has already been called" before issue 37
    assert all(p.grad.abs().max() < 100 for p in model.parameters()), "the gradients are unscaled"
    scaler.step(wrapped)
    scaler.update()


def test_the_per_optimizer_stage_and_found_inf_travel_with_the_state():
    model, opt, scaler = _model_and_scaler(init_scale=2.0 ** 127)
    _backward(model, scaler, 1e6)  # overflows: found-inf set
    scaler.unscale_(opt)
    saved = ScalerState(scaler, {"optimizer": opt}).state_dict()
    assert saved["optimizers"]["optimizer"]["stage"] == OptState.UNSCALED.value
    assert saved["optimizers"]["optimizer"]["found_inf"]["cpu"].item() == 1.0
    again = unpack(pack({"scaler": saved}))["scaler"]  # as an own part's bytes: tensors, no pickles

    model2, opt2, scaler2 = _model_and_scaler()
    ScalerState(scaler2, {"optimizer": opt2}).load_state_dict(again)
    assert scaler2.get_scale() == 2.0 ** 127  # before its first scale(): made from the loaded value
    scaler2.scale(torch.ones(()))
    per = scaler2._per_optimizer_states[id(opt2)]
    assert per["stage"] is OptState.UNSCALED and per["found_inf_per_device"][torch.device("cpu")].item() == 1.0
    with pytest.raises(RuntimeError, match="already been called"):
        scaler2.unscale_(opt2)  # exactly as the scaler it came from
    scaler2.step(opt2)  # skipped: found inf
    scaler2.update()
    scaler.step(opt)
    scaler.update()
    assert scaler2.state_dict() == scaler.state_dict() == {**scaler.state_dict(), "scale": 2.0 ** 126}


def test_a_scaler_state_saved_before_issue_37_still_loads():
    _, opt, scaler = _model_and_scaler()
    old = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2, "_growth_tracker": 1}
    scaler._per_optimizer_states[id(opt)]["stage"] = OptState.UNSCALED
    ScalerState(scaler, {"optimizer": opt}).load_state_dict(old)
    assert scaler.get_scale() == 1024.0 and scaler._get_growth_tracker() == 1
    assert not scaler._per_optimizer_states, "ready, as after update()"


def _stepping(scaler_given, scaler_used, caplog):
    model, opt, _ = _model_and_scaler()
    undeclared = Undeclared(scaler_given, None, {"optimizer": opt}, warn=True)
    wrapped = GuardedOptimizer(opt, lambda: undeclared.update_starts(sys._getframe(1)), lambda: None)
    undeclared._optimizers["guarded"] = wrapped
    with caplog.at_level(logging.WARNING, logger="trainguard.torch"):
        _backward(model, scaler_used)
        scaler_used.step(wrapped)
        scaler_used.update()
    return undeclared


def test_a_scaler_stepping_the_guards_optimizer_unknown_to_it_is_named(caplog):
    scaler = _model_and_scaler()[2]
    undeclared = _stepping(None, scaler, caplog)
    assert "was not given to the Guard as scaler=" in undeclared.found["scaler"]
    assert "Pass Guard(..., scaler=scaler)" in caplog.text
    assert undeclared.scaler is not None and undeclared.scaler.scaler is scaler, "fingerprinted for a rehearsal"


def test_the_scaler_given_is_not_named(caplog):
    scaler = _model_and_scaler()[2]
    assert not _stepping(scaler, scaler, caplog).found and not caplog.text


def _loop_frame_iterating(loader, how: str):
    if how == "iterator":
        batches = iter(loader)  # noqa: F841 - what the scan finds
    elif how == "generator":
        def forever():
            while True:
                yield from loader
        batches = forever()
        next(batches)
    return sys._getframe()


@pytest.mark.parametrize("how", ["iterator", "generator"])
def test_a_loader_the_loop_iterates_but_did_not_give_as_data_is_named(caplog, how):
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    dataset = TensorDataset(torch.arange(8))
    loader = torchdata.StatefulDataLoader(dataset, batch_size=2)
    undeclared = Undeclared(None, None, {}, warn=True)
    with caplog.at_level(logging.WARNING, logger="trainguard.torch"):
        undeclared.loop_ran(_loop_frame_iterating(loader, how))
    assert "not given to the Guard as data=" in undeclared.found["data"] and "`" in undeclared.found["data"]
    assert "Pass data=loader" in caplog.text

    from trainguard.adapters.torch.data import resumable
    given = Undeclared(None, resumable(loader), {}, warn=True)
    given.loop_ran(_loop_frame_iterating(loader, how))
    assert not given.found, "the loader given is not named"
    plain = Undeclared(None, None, {}, warn=True)
    plain.loop_ran(_loop_frame_iterating(DataLoader(dataset, batch_size=2), how))
    assert "data" in plain.found, "a plain DataLoader too"
