"""The Guard's step API (begin_step / end_step / fail_step) and the
optimizer wrapper's closure, in one process (world size 1, no controller).

The same API under real faults on two ranks: the integrations' jobs
(tests/test_integrations*.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.core import ConfigError, DataStatus
from trainguard.torch import Guard, state_sha256


@pytest.fixture
def world(tmp_path, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(name)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield tmp_path
    dist.destroy_process_group()


def make(optimizer=torch.optim.SGD, **kwargs):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1)))
    return model, optimizer(model.parameters(), **(kwargs or {"lr": 0.1}))


def batch(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def test_an_update_outside_a_step_is_refused_naming_the_fix(world):
    model, opt = make()
    guard = Guard(model, opt)
    for _ in range(2):  # before: the first passed, the second died on UPDATING -> UPDATING
        model(batch(0)).square().mean().backward()
        with pytest.raises(ConfigError, match=r"outside a step.*guard\.begin_step\(\).*guard\.end_step\(\)"):
            guard.optimizer.step()
    assert guard.processor.data is DataStatus.UPDATED and guard.step == 0
    guard.close()


def test_two_updates_in_one_step_are_refused(world):
    model, opt = make()
    guard = Guard(model, opt)
    guard.begin_step()
    model(batch(0)).square().mean().backward()
    guard.optimizer.step()
    with pytest.raises(ConfigError, match="twice in one step"):
        guard.optimizer.step()
    guard.close(finished=False)


def test_the_step_api_trains_as_steps_and_protect_do(world):
    model, opt = make()
    guard = Guard(model, opt)
    for step in guard.steps(4):
        with guard.protect():
            guard.optimizer.zero_grad()
            model(batch(step)).square().mean().backward()
            guard.optimizer.step()
    by_sugar = state_sha256(guard.state.model_and_optimizer())
    guard.close()

    model, opt = make()
    guard = Guard(model, opt)
    while guard.step < 4:
        step = guard.begin_step()
        guard.optimizer.zero_grad()
        model(batch(step)).square().mean().backward()
        guard.optimizer.step()
        assert guard.end_step() is True
    assert state_sha256(guard.state.model_and_optimizer()) == by_sugar
    guard.close()


def test_without_a_controller_fail_step_raises_the_error(world):
    model, opt = make()
    guard = Guard(model, opt)
    guard.begin_step()
    error = RuntimeError("UCE ERROR in the forward pass")
    with pytest.raises(RuntimeError, match="UCE ERROR") as raised:
        guard.fail_step(error)
    assert raised.value is error
    with pytest.raises(KeyboardInterrupt):  # no fault: handed back as it is
        guard.fail_step(KeyboardInterrupt())
    guard.close(finished=False)


def test_a_closure_runs_before_the_update_is_reported_started(world):
    model, opt = make()
    guard = Guard(model, opt)
    seen = []

    def closure():
        seen.append(guard.processor.data)
        guard.optimizer.zero_grad()
        loss = model(batch(guard.step)).square().mean()
        loss.backward()
        return loss

    for _ in guard.steps(2):
        with guard.protect():
            loss = guard.optimizer.step(closure)
            assert isinstance(loss, torch.Tensor)
    assert seen == [DataStatus.UPDATED, DataStatus.UPDATED]  # before: UPDATING (a fault there saved nothing)
    guard.close()


def test_lbfgs_through_the_wrapper_matches_lbfgs_alone(world):
    def closure_for(model, optimizer, step):
        def closure():
            optimizer.zero_grad()
            loss = model(batch(step)).square().mean()
            loss.backward()
            return loss
        return closure

    model, opt = make(torch.optim.LBFGS, lr=0.5, max_iter=4)
    model.eval()  # no dropout: LBFGS evaluates the closure several times per step
    for step in range(3):
        opt.step(closure_for(model, opt, step))
    alone = state_sha256({"model": model.module.state_dict(), "optimizer": opt.state_dict()})

    model, opt = make(torch.optim.LBFGS, lr=0.5, max_iter=4)
    model.eval()
    guard = Guard(model, opt)
    for step in guard.steps(3):
        with guard.protect():
            guard.optimizer.step(closure_for(model, guard.optimizer, step))
    assert state_sha256(guard.state.model_and_optimizer()) == alone
    guard.close()
