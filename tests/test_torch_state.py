"""State flattening, hashing and rank-to-rank transfer (two ranks on threads)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from trainguard.core import ForceStop, RecoveryError
from trainguard.torch import AbortableProcessGroup, state_sha256
from trainguard.adapters.torch.state import flatten, recv_state, send_state, unflatten

from conftest import ROOT, WORKERS

CPU = torch.device("cpu")


def sample_state():
    return {
        "model": {"w": torch.randn(3, 4), "n": torch.tensor(7), "h": torch.randn(5).half()},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "nesterov": False,
                                        "name": None}]},
    }


def assert_same(a, b):
    assert state_sha256(a) == state_sha256(b)


def test_flatten_roundtrip_keeps_int_keys_and_tuples():
    state = sample_state()
    skeleton, tensors = flatten(state)
    back = unflatten(skeleton, tensors)
    assert set(back["optimizer"]["state"]) == {0}
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert_same(state, back)


def test_unsupported_values_are_named():
    with pytest.raises(TypeError, match=r"cannot carry a set at .model.bad"):
        flatten({"model": {"bad": {1, 2}}})


def test_hash_sees_values_dtypes_and_shapes():
    a = {"t": torch.zeros(4)}
    assert state_sha256(a) != state_sha256({"t": torch.zeros(2, 2)})
    assert state_sha256(a) != state_sha256({"t": torch.zeros(4, dtype=torch.float64)})
    b = {"t": torch.zeros(4)}
    b["t"][2] = 1e-30
    assert state_sha256(a) != state_sha256(b)


def two_ranks(fn, group_cls=AbortableProcessGroup):
    store = dist.HashStore()
    results, errors = {}, {}

    def run(rank):
        try:
            results[rank] = fn(group_cls(store, rank, 2), rank)
        except BaseException as e:  # reported to the test below
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def transfer(state, into=None, group_cls=AbortableProcessGroup):
    """``state`` sent by rank 0 and received by rank 1 (into ``into``):
    rank 1's result, the errors, and each rank's group."""
    groups = {}

    def body(group, rank):
        groups[rank] = group
        if rank == 0:
            send_state(group, state, 1, device=CPU)
            return None
        return recv_state(group, 0, device=CPU, into=into)

    results, errors = two_ranks(body, group_cls)
    return results.get(1), errors, groups


def test_state_moves_between_ranks_intact():
    state = sample_state()
    got, errors, _ = transfer(state)
    assert not errors, errors
    assert_same(got, state)


def test_state_lands_in_the_receivers_own_tensors_where_they_fit():
    state = sample_state()
    mine = sample_state()
    mine["model"]["h"] = torch.zeros(7).half()  # a different shape: must be allocated, not overwritten
    own_w, own_h = mine["model"]["w"], mine["model"]["h"]
    got, errors, _ = transfer(state, mine)
    assert not errors, errors
    assert_same(got, state)
    assert got["model"]["w"] is own_w and torch.equal(own_w, state["model"]["w"])
    assert got["model"]["h"] is not own_h and own_h.shape == (7,)


class CountingGroup(AbortableProcessGroup):
    """Counts the bytes of tensors (tags from 4: not the header) this rank
    has posted and not yet waited for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.posted = self.most = 0

    def _counted(self, work, tensors, tag):
        size = sum(t.numel() * t.element_size() for t in tensors) if tag >= 4 else 0
        self.posted += size
        self.most = max(self.most, self.posted)
        group = self

        class Counted:
            def wait(self, *args):
                result = work.wait(*args)
                group.posted -= size
                return result

        return Counted()

    def send(self, tensors, dst, tag=0):
        return self._counted(super().send(tensors, dst, tag), tensors, tag)

    def recv(self, tensors, src, tag=0):
        return self._counted(super().recv(tensors, src, tag), tensors, tag)


def test_transfers_are_posted_ahead_within_the_window(monkeypatch):
    """Tensors go out without a round trip each, but never more than the
    window (plus one message) at once: a host state sent over NCCL holds a
    device copy of each tensor in flight."""
    monkeypatch.setattr("trainguard.adapters.torch.state.IN_FLIGHT_BYTES", 4000)
    monkeypatch.setattr("trainguard.adapters.torch.state.BUCKET_BYTES", 2000)
    state = {f"t{i}": torch.randn(250) for i in range(40)}  # 1000 bytes each: two to a message
    mine = {f"t{i}": torch.zeros(250) for i in range(40)}
    own = dict(mine)
    got, errors, groups = transfer(state, mine, CountingGroup)
    assert not errors, errors
    assert_same(got, state)
    assert all(got[k] is own[k] for k in own)  # received in place
    for group in groups.values():
        assert 2000 <= group.most <= 6000, group.most


class MessageCountingGroup(AbortableProcessGroup):
    """Counts the data messages (tags from 4) this rank posts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages = 0

    def send(self, tensors, dst, tag=0):
        self.messages += tag >= 4
        return super().send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        self.messages += tag >= 4
        return super().recv(tensors, src, tag)


def test_small_tensors_travel_packed_and_land_in_place(monkeypatch):
    """An optimizer's many small tensors (steps, biases, of every dtype,
    empty ones too) share messages; a large one goes alone; each lands in
    the receiver's own tensor, bit for bit."""
    monkeypatch.setattr("trainguard.adapters.torch.state.BUCKET_BYTES", 4096)
    g = torch.Generator().manual_seed(3)
    state = {"big": torch.randn(2048, generator=g), "steps": [torch.tensor(float(i)) for i in range(50)],
             "flags": torch.rand(33, generator=g) > 0.5, "half": torch.randn(7, 3, generator=g).half(),
             "ids": torch.randint(0, 1 << 40, (9,), generator=g), "none": torch.empty(0),
             "tail": torch.randn(2, 5, generator=g).double()}
    mine = {"big": torch.zeros(2048), "steps": [torch.tensor(0.0) for _ in range(50)],
            "flags": torch.zeros(33, dtype=torch.bool), "half": torch.zeros(7, 3).half(),
            "ids": torch.zeros(9, dtype=torch.int64), "none": torch.empty(0), "tail": torch.zeros(2, 5).double()}
    own = [mine["big"], mine["flags"], mine["ids"], mine["steps"][17]]
    got, errors, groups = transfer(state, mine, MessageCountingGroup)
    assert not errors, errors
    assert_same(got, state)
    assert all(a is b for a, b in zip([got["big"], got["flags"], got["ids"], got["steps"][17]], own))
    assert torch.equal(own[1], state["flags"]) and torch.equal(own[2], state["ids"])
    assert got["steps"][17] is own[3] and own[3].item() == 17.0
    # 'big' (8 KB) alone; the 55 small tensors (about 700 bytes) in one message
    assert groups[0].messages == groups[1].messages == 2


class FlippingGroup(AbortableProcessGroup):
    """Flips one byte of the first tensor this rank receives (tag 4)."""

    def recv(self, tensors, src, tag=0):
        work = super().recv(tensors, src, tag)
        if self.rank() == 1 and tag == 4:
            work.wait()
            tensors[0].view(torch.uint8)[5] ^= 0xFF
        return work


def test_a_corrupted_transfer_is_detected():
    _, errors, _ = transfer({"w": torch.randn(1000)}, group_cls=FlippingGroup)
    assert isinstance(errors.get(1), RecoveryError) and "fails its checksum" in str(errors[1])


def test_stop_releases_a_blocked_collective_and_refuses_new_ones():
    done = threading.Event()

    def body(group, rank):
        if rank == 1:
            done.wait(30)  # alive but never joins the all-reduce: rank 0 would wait for gloo's timeout
            return "idle"
        work = group.allreduce([torch.ones(3)])
        threading.Timer(0.2, group.stop).start()
        with pytest.raises(ForceStop):
            work.wait()
        with pytest.raises(ForceStop, match="refused"):
            group.allreduce([torch.ones(3)]).wait()
        done.set()
        return "released"

    results, errors = two_ranks(body)
    assert not errors, errors
    assert results == {0: "released", 1: "idle"}


class _LateCallbacks(torch.futures.Future):
    """A backend's future whose completion callbacks have not run yet (in a
    real process they wait for the GIL, which a STOP's thread may hold)."""

    def then(self, callback):
        self.callbacks = [*getattr(self, "callbacks", []), callback]
        return self


class _Work:
    def __init__(self) -> None:
        self.future = _LateCallbacks()

    def get_future(self):
        return self.future


class _Backend:
    def __init__(self) -> None:
        self.works: list[_Work] = []

    def allreduce(self, tensors, opts):
        self.works.append(_Work())
        return self.works[-1]


def test_stop_keeps_a_collective_the_backend_completed_before_its_callback_ran():
    """CI saw a rank stop one step behind its peer: the all-reduce of the
    step had completed on both, but the STOP failed it on the rank whose
    completion callback had not run yet. Such a collective keeps its result;
    one still waiting on a peer is released."""
    backend = _Backend()
    group = AbortableProcessGroup(dist.HashStore(), 0, 1, backend_factory=lambda *_: backend)
    done, waiting = group.allreduce([torch.ones(3)]), group.allreduce([torch.ones(3)])
    backend.works[0].future.set_result([torch.full((3,), 2.0)])  # completed, callback not run
    group.stop("a peer failed")
    assert done.wait() and torch.equal(done.get_future().value()[0], torch.ones(3))  # the result, not a ForceStop
    with pytest.raises(ForceStop, match="a peer failed"):
        waiting.wait()
    assert not group.busy
    backend.works[0].future.callbacks[0](backend.works[0].future)  # the late callback: no second completion


class _BlockingBackend:
    """A backend whose destructor waits, as gloo's does for a call still
    pending with a peer that is frozen or cut off (it never closes its end)."""

    def __init__(self, release: threading.Event, destroyed: list) -> None:
        self.release, self.destroyed = release, destroyed

    def __del__(self) -> None:
        self.release.wait(30)
        self.destroyed.append(threading.current_thread().name)


@pytest.mark.parametrize("how", ["rebuild", "replace_backend"])
def test_the_abandoned_backend_is_destroyed_off_the_training_thread(how):
    """A rebuild (and a regroup's ``replace_backend(None)``) hands the old
    backend to a thread of its own: the training thread goes on at once
    even when that backend's destructor waits on an unreachable peer. (A
    local name still holding it used to run the destructor on the training
    thread, which then waited on a frozen host for good.)"""
    release, destroyed = threading.Event(), []
    built = [_BlockingBackend(release, destroyed), object()]  # handed out, not kept
    group = AbortableProcessGroup(dist.HashStore(), 0, 1, backend_factory=lambda *_: built.pop(0))
    returned = threading.Event()

    def replace():
        group.rebuild(1) if how == "rebuild" else group.replace_backend(None)
        returned.set()

    trainer = threading.Thread(target=replace, name="training")
    trainer.start()
    try:
        assert returned.wait(10), "the training thread waited on the old backend's destructor"
        assert destroyed == []
    finally:
        release.set()
        trainer.join(10)
    for _ in range(1000):
        if destroyed:
            break
        time.sleep(0.01)
    assert destroyed == ["trainguard-pg-retire"]


@pytest.mark.parametrize("how", ["callback", "retiring"])
def test_a_process_ending_with_backend_threads_still_in_python_exits_with_its_code(how):
    """CI saw a finished worker of a plain torchrun job abort at exit
    ("terminate called without an active exception", SIGABRT): a gloo
    thread of the Guard's group still had Python to run when the interpreter
    finalized. Here a collective's completion callback sleeps past the end of
    the script (``callback``), also while a rebuild retires that backend
    (``retiring``), and the module's teardown is slow; the exit waits for
    those threads and the process ends with code 0 after the callback ran.
    Without the exit handling both abort, every time."""
    out = subprocess.run([sys.executable, str(WORKERS / "exit_in_flight.py"), how], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["callback done"]
    assert "terminate called" not in out.stderr and "Fatal Python error" not in out.stderr


@pytest.mark.parametrize("broadcast", [True, False])
def test_the_survivors_mirror_of_ddp_start_up_reads_the_buffer_setting_of_an_older_torch(monkeypatch, broadcast):
    """Before torch 2.13, DDP kept its buffer sync as ``broadcast_buffers``
    alone (an H200's torch 2.11 had no ``forward_sync_buffers`` and a
    restarted process's join failed on it): the mirror of DDP's start-up
    collectives reads whichever is there, and sends the buffers when it says so."""
    from types import SimpleNamespace

    from trainguard.adapters.torch import join

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    older = SimpleNamespace(module=net, parameters_to_ignore=set(), broadcast_bucket_size=1 << 20,
                            broadcast_buffers=broadcast, _build_params_for_reducer=lambda: (list(net.parameters()), []))
    sent = []
    monkeypatch.setattr(join, "_verify_param_shape_across_processes", lambda group, params: None)
    monkeypatch.setattr(join, "_sync_params_and_buffers", lambda group, states, size, src: sent.append(len(states)))
    join._mirror_ddp(older, group=None)
    assert sent == [4 + (3 if broadcast else 0)]  # 4 parameters, BatchNorm's 3 buffers
