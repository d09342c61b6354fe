"""The torch Guard's contract, in one process (world size 1, no controller)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard.core import ConfigError, FaultInjector, FaultSpec
from trainguard.torch import Guard, GuardedOptimizer, state_sha256


@pytest.fixture
def world(tmp_path, monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(name)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield tmp_path
    dist.destroy_process_group()


def make(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def train(guard, model, steps, scaler=None, sched=None):
    for step in guard.steps(steps):
        with guard.protect():
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4, 8, generator=g)
            loss = model(x).square().mean()
            guard.optimizer.zero_grad()
            if scaler is None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                guard.optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(guard.optimizer)
                scaler.step(guard.optimizer)
                scaler.update()
            if sched is not None:
                sched.step()


def test_wrapper_behaves_like_the_optimizer_for_schedulers_and_scalers(world):
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    guard = Guard(model, opt, scheduler=sched, scaler=scaler)
    assert isinstance(guard.optimizer, GuardedOptimizer)
    assert guard.optimizer.param_groups is opt.param_groups
    train(guard, model, 5, scaler=scaler, sched=sched)
    assert guard.step == 5 and guard.processor.step == 5
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
    guard.close()


def test_a_snapshot_copied_beside_the_next_step_holds_its_own_step(world, monkeypatch):
    """Snapshots are copied on a thread while the next step computes; the
    next update waits for the copy, so each snapshot holds the state of its
    own step even when its copy is slow."""
    import copy
    import time

    from trainguard.adapters.torch import snapshot as module
    from trainguard.adapters.torch.snapshot import read_payload

    real = module._copy

    def slow_copy(views, tensors):
        time.sleep(0.3)  # far longer than this model's forward and backward
        real(views, tensors)
    monkeypatch.setattr(module, "_copy", slow_copy)
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_ROOT", str(world))
    model, opt = make()
    guard = Guard(model, opt, snapshot_every=1)
    committed = {}
    for step in guard.steps(3):
        with guard.protect():
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean()
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
        state = guard.state.committed_state_dict()
        committed[guard.step] = copy.deepcopy({"model": state["model"], "optimizer": state["optimizer"]["state"]})
    snaps = guard.snapshots
    snaps.settle()
    assert snaps.waited > 0  # the updates of steps 2 and 3 waited for the copies
    for step in (2, 3):
        slot = snaps.slots[snaps.holding(step)]
        slot.lock(False, block=True)
        try:
            got = read_payload(slot.payload())[1]["state"]
        finally:
            slot.unlock()
        assert state_sha256({"model": got["model"], "optimizer": got["optimizer"]["state"]}) == \
            state_sha256(committed[step]), step
    assert state_sha256(committed[2]) != state_sha256(committed[3])
    guard.close()


def test_snapshots_copied_in_line_when_overlap_is_off_and_a_bad_value_is_refused(world, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_OVERLAP", "yes")
    with pytest.raises(ConfigError, match="TRAINGUARD_SNAPSHOT_OVERLAP='yes'"):
        Guard(*make(), snapshot_every=1)  # refused before anything is built
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_OVERLAP", "0")
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_ROOT", str(world))
    model, opt = make()
    guard = Guard(model, opt, snapshot_every=1)
    train(guard, model, 2)
    assert guard.snapshots.pending is None and guard.snapshots._copier is None  # no copy ever left running
    assert guard.snapshots.holding(2) is not None and guard.snapshots.taken == 2
    guard.close()


def test_the_rank_s_fault_and_store_settings_reach_the_guard_s_parts(world, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_FAULT", "uce:rank=0")
    with pytest.raises(ConfigError, match="TRAINGUARD_FAULT: bad fault 'uce:rank=0': missing step"):
        Guard(*make())  # refused before anything is built
    monkeypatch.setenv("TRAINGUARD_FAULT", "uce:rank=0,step=7,phase=backward")
    monkeypatch.setenv("TRAINGUARD_STORE_ROUND", "41234")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    guard = Guard(*make())
    assert guard.injector.specs == tuple(FaultSpec.parse("uce:rank=0,step=7,phase=backward"))
    assert guard.injector.wants("backward")
    assert guard.process_group._namespace == "trainguard/job-a/41234"
    guard.close()


def test_ddp_keeps_its_initial_bucket_layout_when_summation_order_matters(world):
    # With 3+ ranks, a rebuild after the first step would make a relaunched
    # process (which starts with the initial layout) sum gradients in another
    # order. (This world has one rank: pretend it has three.)
    model, opt = make()
    guard = Guard(model, opt)
    guard.comm.world_size = 3
    train(guard, model, 4)
    assert model._get_ddp_logging_data().get("has_rebuilt_buckets", 0) == 0
    guard.close()


def test_the_loop_body_must_be_protected(world):
    model, opt = make()
    guard = Guard(model, opt)
    with pytest.raises(ConfigError, match="with guard.protect"):
        for _ in guard.steps(3):
            pass
    guard.close()


def test_wrong_usage_is_refused(world):
    model, opt = make()
    with pytest.raises(ConfigError, match="pass the plain optimizer"):
        Guard(model, GuardedOptimizer(opt, lambda: None, lambda: None))
    with pytest.raises(ConfigError, match="save_every needs a checkpoint_dir"):
        Guard(model, opt, save_every=5)
    model.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    with pytest.raises(ConfigError, match="its own DDP comm hook"):
        Guard(model, opt)
    model, opt = make()
    injector = FaultInjector(FaultSpec.parse("crash:rank=0,step=2,phase=reduce"), rank=0)
    with pytest.raises(ConfigError, match="phase=reduce is the MindSpore Guard's"):
        Guard(model, opt, injector=injector)
    model, opt = make()
    with pytest.raises(ConfigError, match="snapshot_shared with snapshot_peer is not supported"):
        Guard(model, opt, snapshot_every=1, snapshot_shared=True, snapshot_peer=True)


def test_without_a_controller_a_fault_is_raised_not_swallowed(world):
    model, opt = make()
    injector = FaultInjector(FaultSpec.parse("uce:rank=0,step=2,phase=backward"), rank=0)
    guard = Guard(model, opt, injector=injector)
    with pytest.raises(RuntimeError, match="UCE ERROR"):
        train(guard, model, 5)
    assert guard.step == 2
    guard.close()


def test_periodic_checkpoints_resume_to_the_same_state(world):
    ckpt = world / "ckpt"
    model, opt = make()
    guard = Guard(model, opt, checkpoint_dir=ckpt, save_every=3)
    train(guard, model, 8)
    straight = state_sha256({"model": model.module.state_dict(), "optimizer": opt.state_dict()})
    guard.close()
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step")) == ["step_00000003",
                                                                                  "step_00000006"]

    model, opt = make(seed=1)  # different init: everything must come from the checkpoint
    guard = Guard(model, opt, checkpoint_dir=ckpt)
    assert guard.step == 6
    train(guard, model, 8)
    resumed = state_sha256({"model": model.module.state_dict(), "optimizer": opt.state_dict()})
    guard.close()
    assert resumed == straight


def test_lr_factor_scales_the_update_only():
    import torch

    from trainguard.adapters.torch.optimizer import GuardedOptimizer

    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    b.load_state_dict(a.state_dict())
    guarded = GuardedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), lambda: None, lambda: None)
    plain = torch.optim.SGD(b.parameters(), lr=0.05)
    guarded.lr_factor = 0.5
    x = torch.randn(8, 4)
    for model, opt in ((a, guarded), (b, plain)):
        model(x).sum().backward()
        opt.step()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert guarded.param_groups[0]["lr"] == 0.1  # what the scheduler sees is unchanged


@pytest.mark.parametrize("draws_in_between", [False, True])
def test_the_own_part_is_recorded_before_the_gradients_leave_unless_the_script_draws_after(
        world, monkeypatch, draws_in_between):
    """Once a rank's gradients reached its peers, they can commit the step
    while it dies before its update: its node must already hold its own part
    of that step. Not at the first step (not known yet whether the script
    draws random numbers between its backward pass and its update), and
    never for a script that does (the record would be wrong)."""
    from trainguard.core.snapshot.own import read_own

    node = world / "node"
    node.mkdir()
    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_DIR", str(node))
    model, opt = make()
    guard = Guard(model, opt)
    early = []
    for step in guard.steps(4):
        with guard.protect():
            loss = model(torch.randn(4, 8)).square().mean()
            guard.optimizer.zero_grad()
            loss.backward()
            early.append(read_own(node, 0, step + 1))
            if draws_in_between:
                torch.rand(1)
            guard.optimizer.step()
            at_update = read_own(node, 0, step + 1)
            if early[-1] is not None:
                assert early[-1] == at_update, "recorded when the gradients left as it is at the update"
    if draws_in_between:
        assert early == [None] * 4
    else:
        assert early[0] is None and all(e is not None for e in early[1:]), early
    assert read_own(node, 0, 4) is not None and read_own(node, 0, 3) is not None, "the step before stays"
    guard.close()
