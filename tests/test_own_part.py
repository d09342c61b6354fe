"""A rank's own part -- random streams and data position, which replicas do
not share -- outlives its process: recorded in the node agent's memory at
every update, packed without pickling, never put on a device by a load.
(The jobs that show it end to end are in ``test_fault_matrix.py``.)"""

from __future__ import annotations

import hashlib
import json
import os
import random
import types

import numpy as np
import pytest
import torch

from trainguard.adapters.torch.own import pack, unpack
from trainguard.adapters.torch.snapshot import Snapshots, on_device, read_payload_into
from trainguard.adapters.torch.trainstate import TrainState
from trainguard.core import CheckpointError
from trainguard.core.checkpoint import FileInfo
from trainguard.core.snapshot import SnapshotDir
from trainguard.core.snapshot.own import OwnRecords, carry, read_own


class Position:
    """A data position with a generator, as samplers keep them."""

    def __init__(self) -> None:
        self.epoch, self.g = 0, torch.Generator().manual_seed(3)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "generator": self.g.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.g.set_state(state["generator"])


def train_state(rank: int = 1) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return TrainState(model, opt, data=Position(), rank=rank)


def test_records_alternate_keep_the_previous_step_and_survive_a_torn_write(tmp_path):
    rec = OwnRecords(tmp_path, 3)
    rec.write(5, b"five")
    rec.write(6, b"six")
    assert read_own(tmp_path, 3, 5) == b"five" and read_own(tmp_path, 3, 6) == b"six"
    rec.write(7, b"seven")  # replaces step 5's record, not step 6's
    assert read_own(tmp_path, 3, 5) is None and read_own(tmp_path, 3, 6) == b"six"
    raw = bytearray((tmp_path / "own-r3").read_bytes())
    at = raw.index(b"seven")
    raw[at] ^= 1  # a write torn by a kill: its checksum fails
    (tmp_path / "own-r3").write_bytes(bytes(raw))
    assert read_own(tmp_path, 3, 7) is None and read_own(tmp_path, 3, 6) == b"six"
    rec.close()


def test_a_step_recorded_again_replaces_its_own_record_and_the_step_before_stays(tmp_path):
    rec = OwnRecords(tmp_path, 0)
    rec.write(5, b"five")
    rec.write(6, b"six, when the gradients left")
    rec.write(6, b"six, at the update")
    assert read_own(tmp_path, 0, 5) == b"five" and read_own(tmp_path, 0, 6) == b"six, at the update"
    rec.write(7, b"seven")  # replaces step 5's record, the older
    assert read_own(tmp_path, 0, 5) is None and read_own(tmp_path, 0, 6) == b"six, at the update"
    assert read_own(tmp_path, 0, 7) == b"seven"
    rec.close()


def test_a_record_that_outgrows_its_file_moves_to_a_bigger_one_whole(tmp_path):
    rec = OwnRecords(tmp_path, 0)
    rec.write(1, b"small")
    big = os.urandom(100_000)
    rec.write(2, big)
    assert read_own(tmp_path, 0, 2) == big and read_own(tmp_path, 0, 1) == b"small"
    assert not list(tmp_path.glob("*.new"))
    rec.close()


def test_a_planted_link_or_foreign_file_is_not_read_or_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_bytes(b"root-owned")
    (tmp_path / "own-r0").symlink_to(target)
    assert read_own(tmp_path, 0, 1) is None
    OwnRecords(tmp_path, 0).write(1, b"x")  # a file of its own replaces the link
    assert target.read_bytes() == b"root-owned" and not (tmp_path / "own-r0").is_symlink()
    assert read_own(tmp_path, 0, 1) == b"x"
    (tmp_path / "own-r1").write_bytes(b"garbage" * 100)
    assert read_own(tmp_path, 1, 1) is None
    os.mkfifo(tmp_path / "own-r2")
    assert read_own(tmp_path, 2, 1) is None, "a FIFO must neither block nor be read"


def test_a_survivor_carries_the_lost_ranks_good_records_and_warns_for_the_rest(tmp_path, caplog):
    for rank, data in ((1, b"one"), (3, b"bad")):
        with_record = OwnRecords(tmp_path, rank)
        with_record.write(7, data)
        with_record.close()

    def check(rank: int, data: bytes, what: str) -> None:
        if data == b"bad":
            raise CheckpointError(f"{what} is not one")
    written = carry([1, 2, 3], 7, by=0, recorded=lambda r, s: read_own(tmp_path, r, s), check=check,
                    write=lambda step, rank, data: (step, rank, data))
    assert written == [(7, 1, b"one")]  # rank 2 left no record, rank 3's fails the adapter's check
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["rank 0 cannot carry rank 2's own part (random streams, data position): there is no rank 2's "
                      "record of step 7 on this node",
                      "rank 0 cannot carry rank 3's own part (random streams, data position): rank 3's record of "
                      "step 7 on this node is not one"], warned


def test_an_own_part_packs_and_unpacks_exactly_and_malformed_bytes_are_refused():
    state = train_state()
    random.seed(11)
    np.random.seed(12)
    own = state.own_part()
    back = unpack(pack(own))
    assert pack(back) == pack(own)
    data = pack(own)
    for bad in (data[:-1], data + b"x", b"\xff" * 16, data[:8] + b"[" + data[9:]):
        with pytest.raises(CheckpointError, match="malformed"):
            unpack(bad)


def test_loading_an_own_part_sets_the_streams_and_the_data_position_of_this_rank_only():
    state = train_state(rank=1)
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    state.host["data"].epoch = 4
    state.host["data"].g.manual_seed(99)
    own = unpack(pack(state.own_part()))
    expect = (torch.rand(3), random.random(), np.random.rand(), state.host["data"].g.get_state())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    state.host["data"].epoch, _ = 0, state.host["data"].g.manual_seed(0)
    state.load_own(own)
    assert state.host["data"].epoch == 4 and torch.equal(state.host["data"].g.get_state(), expect[3])
    assert torch.equal(torch.rand(3), expect[0]) and random.random() == expect[1] and np.random.rand() == expect[2]
    with pytest.raises(KeyError):
        train_state(rank=0).load_own(own)  # rank 1's part is not rank 0's


def test_streams_drawn_after_the_update_began_are_noticed():
    state = train_state()
    state.own_part()
    state.commit(1)
    assert not state.streams_moved()
    state.own_part()
    torch.rand(1)  # drawn between the update's start and the commit
    state.commit(2)
    assert state.streams_moved()


def test_a_load_puts_only_model_and_optimizer_tensors_on_the_device(tmp_path):
    """The CUDA restart from memory crashed in numpy: the random streams had
    been placed on the device. "meta" stands in for a device on a CPU host:
    anything host-only placed there cannot be read back and fails here."""
    state = train_state()
    np.random.seed(1)
    state.commit(3)
    held = {"state": {**state.committed_state_dict(), "step": 3}, "history": {}}
    directory = SnapshotDir.create(f"own-{os.getpid()}", tmp_path)
    snaps = Snapshots(directory, 1, count=1)
    try:
        index = snaps.take(held, 3)
        slot = snaps.slots[index]
        slot.lock(False, block=True)
        step, back, _ = read_payload_into(slot.payload(), "meta", {})
        slot.unlock()
        assert step == 3
        assert all(t.device.type == "meta" for t in back["state"]["model"].values())
        assert back["state"]["optimizer"]["state"][0]["exp_avg"].device.type == "meta"
        host = back["state"]["host"]["data"]["generator"]
        assert host.device.type == "cpu" and torch.equal(host, state.host["data"].g.get_state())
        fresh = train_state()
        fresh.load_own({"rng": back["state"]["rng"], "data": back["state"]["host"]["data"]})
        assert torch.equal(torch.get_rng_state(), state.snapshot["rng"]["torch"])
    finally:
        snaps.close()
        directory.remove()
    assert on_device(".state.model.0.weight") and on_device(".state.rank.model1.w")
    assert on_device(".state.optimizer.state.0.exp_avg") and on_device(".state.shards[0].w")
    assert not on_device(".state.rng.1.torch") and not on_device(".state.host.data.model")
    assert not on_device(".state.rank.rng_state[0].cuda_rng_state") and not on_device(".state.modelx")


def test_a_rank_a_step_ahead_saves_its_own_part_of_the_dumped_step_from_its_node_s_record():
    """A dump of the step before this rank's (another rank was a step
    behind): its own part comes from its node's record of that step; with
    no record the save fails and names why (the job falls back)."""
    from types import SimpleNamespace

    from trainguard.adapters.torch.handlers import TorchHandlers

    written = []
    records = {(1, 6): b"rank 1 at step 6"}
    guard = SimpleNamespace(
        rank=1, store=object(), state=SimpleNamespace(snapshot_step=7, committed_own=lambda: {"rng": {}}),
        recorded_own=lambda rank, step: records.get((rank, step)),
        write_own=lambda step, rank, data: written.append((step, rank, data)) or f"own-{rank}")
    assert TorchHandlers(guard).save_own(6, []) == ["own-1"]
    assert written == [(6, 1, b"rank 1 at step 6")]
    with pytest.raises(CheckpointError, match="committed step 7, not 5, and its node holds no record of step 5"):
        TorchHandlers(guard).save_own(5, [])


def test_mindspore_file_records_cross_its_32_bit_all_gather_exactly():
    """A MindSpore periodic save gathers each rank's own-part file record as
    integers; MindSpore's CPU AllGather keeps 32 bits of each, so the record
    is made of values that fit and a wider value is refused, not truncated."""
    own = pytest.importorskip("trainguard.adapters.mindspore.own")
    collectives = pytest.importorskip("trainguard.adapters.mindspore.collectives")
    info = FileInfo("own_r1.json", 5120, hashlib.sha256(b"streams").hexdigest())
    ints = own.file_ints(info)
    assert len(ints) == own.FILE_INTS and all(0 <= v < 2**31 for v in ints), ints
    assert own.file_from_ints("own_r1.json", ints) == info
    single = types.SimpleNamespace(world_size=1)
    assert collectives.Collectives.all_gather_ints(single, [7, 2**31 - 1]) == [7, 2**31 - 1]
    with pytest.raises(ValueError, match="32-bit values"):
        collectives.Collectives.all_gather_ints(single, [2**62 + 12345])


def test_mindspore_streams_keep_the_op_seeds_its_functional_random_ops_draw_from():
    """MindSpore's functional random operators (``ops.dropout``...) derive
    each call's seeds from its op-seed table, not from the generator state
    ``ms.get_rng_state`` returns: the streams carry the table, through an
    own-part record too, so a redone step draws the same mask. A record
    written before (no table) leaves the table as it is; a bad one is refused."""
    pytest.importorskip("mindspore")
    import mindspore as ms
    from mindspore import Tensor, ops

    from trainguard.adapters.mindspore import own
    from trainguard.adapters.mindspore.state import set_streams, streams, streams_sha256

    ms.set_seed(7)
    x = Tensor(np.ones((4, 16), np.float32))
    ops.dropout(x, p=0.5, training=True)
    saved = own.unpack(own.pack(streams()), "the record")
    first = ops.dropout(x, p=0.5, training=True).asnumpy()
    assert not np.array_equal(ops.dropout(x, p=0.5, training=True).asnumpy(), first)  # the stream moves on
    moved = streams_sha256()
    set_streams(saved)
    assert np.array_equal(ops.dropout(x, p=0.5, training=True).asnumpy(), first)
    assert streams_sha256() != moved  # the hash sees the op seeds
    record = json.loads(own.pack(streams()))
    assert record["ops"] and all(isinstance(k, str) for k, _, _ in record["ops"]), record["ops"]
    older = own.unpack(json.dumps({k: v for k, v in record.items() if k != "ops"}).encode(), "an older record")
    assert older["ops"] is None
    ops.dropout(x, p=0.5, training=True)  # the op seeds move on from the record's
    table = streams()["ops"]
    set_streams(older)
    assert streams()["ops"] == table != {(k, o): v for k, o, v in record["ops"]}
    for bad in ([[7, 0, 1]], [["dropout", "zero", 1]], "dropout"):
        with pytest.raises(CheckpointError, match="the record is not a record of random streams"):
            own.unpack(json.dumps({**record, "ops": bad}).encode(), "the record")


def test_a_mindspore_own_part_carries_the_ranks_own_batchnorm_statistics():
    """BatchNorm's moving statistics are each rank's own (its batches move
    them; the all-reduce moves gradients only), so a rank's own-part record
    carries them and a resume sets them back over the saver's. A record
    naming other buffers, or of another shape or dtype, is refused; an
    older record without them says so (``None``)."""
    pytest.importorskip("mindspore")
    from mindspore import Tensor, nn

    from trainguard.adapters.mindspore import own
    from trainguard.adapters.mindspore.state import ModelState, streams

    net = nn.SequentialCell([nn.Dense(4, 4), nn.BatchNorm1d(4)])
    state = ModelState(net, nn.SGD(net.trainable_params(), 0.1))
    assert sorted(p.name for p in state.buffers) == ["1.moving_mean", "1.moving_variance"]
    net.set_train(True)
    net(Tensor(np.arange(8, dtype=np.float32).reshape(2, 4)))  # this rank's batch moves its statistics
    state.updating(3)
    mine = {k: v.copy() for k, v in state.buffers_at(3).items()}
    assert not np.array_equal(mine["1.moving_mean"], np.zeros(4, np.float32))
    record = own.unpack(own.pack(streams(), state.buffers_at(3)), "rank 1's record")
    net(Tensor(np.ones((2, 4), np.float32)))  # ... and another's (a load of the saver's) replaces them
    assert not np.array_equal(state.buffers_at(3)["1.moving_mean"], net[1].moving_mean.asnumpy())
    state.set_buffers(record["buffers"], source="rank 1's record")
    assert all(np.array_equal(p.asnumpy(), mine[p.name]) for p in state.buffers)

    raw = json.loads(own.pack(streams(), mine))
    assert own.unpack(json.dumps({k: v for k, v in raw.items() if k != "buffers"}).encode(), "old")["buffers"] is None
    for bad in ([["1.moving_mean", "object", [4], ""]], [["x", "float32", [4], "!!"]], "buffers"):
        with pytest.raises(CheckpointError, match="the record is not a record of random streams"):
            own.unpack(json.dumps({**raw, "buffers": bad}).encode(), "the record")
    other = {**mine, "1.moving_mean": np.zeros(5, np.float32)}
    with pytest.raises(ValueError, match="1.moving_mean is float32\\[5\\], the network has float32\\[4\\]"):
        state.set_buffers(other, source="a record")
    with pytest.raises(ValueError, match="holds buffers"):
        state.set_buffers({"1.moving_mean": mine["1.moving_mean"]}, source="a record")
