"""The torch adapter's recovery handlers (clean, rebuild, repair, rollback,
save, finalise), executed on the training thread by
:func:`trainguard.core.recover`."""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

import torch

from trainguard.core import CheckpointError, RecoveryError, Transfer
from trainguard.core.checkpoint import FileInfo, SavedShard, shard_file
from trainguard.core import Processor
from trainguard.core.rank.recovery import Handlers
from trainguard.core.snapshot.own import carry as carry_records

from .comm import TorchComm
from .fsdp import reset
from .device import Device
from .join import meet
from .own import own_file, pack, unpack
from .process_group import AbortableProcessGroup
from .state import recv_state, send_state
from .trainstate import TrainState

__all__ = ["TorchHandlers", "TorchRank"]

log = logging.getLogger("trainguard.torch")


class TorchRank(Protocol):
    """What the handlers take from the torch :class:`~.guard.Guard`."""

    rank: int
    state: TrainState
    optimizer: Any  # the GuardedOptimizer
    device: Device
    comm: TorchComm
    ddp: Any
    sharding: Any  # a .sharding.Sharding, or None
    mesh_groups: Any  # the .fsdp.MeshGroups of a sharded model, or None
    processor: Processor
    store: Any  # a CheckpointStore, or None
    snapshots: Any  # a SnapshotRing, or None
    history: dict
    replacement: bool  # a new process, until its history came from a replica

    @property
    def process_group(self) -> AbortableProcessGroup: ...

    def merged_history(self, controller: dict) -> dict: ...

    def record_resume(self, record: dict, pids: dict | None) -> None: ...

    def replaced_ranks(self, pids: dict | None) -> list[int]: ...

    def recorded_own(self, rank: int, step: int) -> bytes | None: ...

    def write_shard(self, step: int) -> list[FileInfo]: ...

    def write_own(self, step: int, rank: int, data: bytes) -> FileInfo: ...

    def finalize_checkpoint(self, step: int, shards: Sequence[SavedShard], history: dict,
                            extra: Sequence[FileInfo] = ()) -> None: ...

    def replicas_changed(self, step: int, replicas: int) -> None: ...

    def rolled_back(self, step: int) -> None: ...


class TorchHandlers(Handlers):
    """Recovery commands carried out on one :class:`~.guard.Guard`'s objects."""

    def __init__(self, guard: TorchRank) -> None:
        self.guard = guard
        self._repaired = False

    def clean(self, uce: bool) -> int:
        g = self.guard
        g.optimizer.zero_grad(set_to_none=True)
        if g.sharding is not None:  # FSDP's state of the abandoned step
            reset(g.sharding)
        g.state.restore_buffers()
        self._repaired = False
        return g.device.clean(uce)

    def rebuild(self, generation: int, ranks: Sequence[int], join_store: str = "") -> None:
        g = self.guard
        stops = g.processor.stops
        cancelled = lambda: g.processor.stops != stops  # noqa: E731 - a new STOP abandons the rebuild
        if join_store:
            meet(g.comm, generation, join_store, cancelled, sorted(ranks))
        elif tuple(sorted(ranks)) != g.process_group.members:
            g.comm.regroup(sorted(ranks), generation, cancelled)  # elastic: the job goes on with these ranks
        else:
            g.comm.rebuild(generation, cancelled)
        if g.mesh_groups is not None:
            g.mesh_groups.rebuild(generation, cancelled, store=g.process_group._store if join_store else None)
        if g.ddp is not None:
            g.comm.attach_ddp()  # resets the reducer after the abandoned step

    def repair(self, step: int, transfers: Sequence[Transfer]) -> None:
        g = self.guard
        for t in transfers:
            if g.rank not in (t.src, t.dst):
                continue
            if t.kind != 0:
                raise RecoveryError(f"the torch adapter holds dense state only, not kind {t.kind}")
            if g.rank == t.src:
                if g.state.snapshot_step != step:
                    raise RecoveryError(f"rank {g.rank} is at step {g.state.snapshot_step}, cannot serve step {step}")
                # The history travels too: a new process has none of its own.
                send_state(g.process_group, {"state": g.state.committed_state_dict(),
                                             "history": g.merged_history({})}, g.process_group.group_rank(t.dst),
                           device=g.device.torch_device)
                log.info("rank %d sent its state at step %d to rank %d", g.rank, step, t.dst)
            else:
                g.processor.begin_copy()
                got = recv_state(g.process_group, g.process_group.group_rank(t.src), device=g.device.torch_device,
                                 into={"state": g.state.state_dict()})
                g.state.load_state_dict(got["state"])
                if g.replacement:  # a new process: the replica's history is the job's
                    g.history, g.replacement = got["history"], False
                g.processor.end_copy(step)
                self._repaired = True
                log.info("rank %d took its state at step %d from rank %d", g.rank, step, t.src)

    def rollback(self, step: int) -> None:
        g = self.guard
        if self._repaired:
            # Host objects came from the replica; the random streams and
            # the data position are this rank's own: from its commit, or,
            # a new process, from the record its predecessor left here.
            if g.state.snapshot_step == step:
                g.state.load_own(g.state.committed_own())
            else:
                recorded = g.recorded_own(g.rank, step)
                if recorded is not None:
                    g.state.load_own(unpack(recorded, f"rank {g.rank}'s record of step {step}"))
                    log.info("rank %d took its random streams and data position at step %d from its node's "
                             "record", g.rank, step)
                else:
                    log.warning("rank %d: no record of its random streams and data position at step %d on this "
                                "node (it ran elsewhere): it continues from its seed, so the job is no longer "
                                "bit-identical to a fault-free run", g.rank, step)
        else:
            if g.state.snapshot_step != step:
                raise RecoveryError(f"rank {g.rank} committed step {g.state.snapshot_step} and was not repaired; "
                                    f"it cannot roll back to step {step}")
            g.state.restore_host()
        g.rolled_back(step)

    def save(self, step: int, kind: int) -> Sequence[FileInfo]:
        g = self.guard
        if kind != 0:
            raise CheckpointError(f"the torch adapter holds dense state only, not kind {kind}")
        if g.store is None:
            raise CheckpointError("no checkpoint_dir was given to the Guard, so there is nowhere to save")
        if g.state.snapshot_step != step:
            raise CheckpointError(f"rank {g.rank} committed step {g.state.snapshot_step}, not {step}")
        return g.write_shard(step)

    def save_own(self, step: int, carry: Sequence[int]) -> Sequence[FileInfo]:
        g = self.guard
        if g.store is None:
            raise CheckpointError("no checkpoint_dir was given to the Guard, so there is nowhere to save")
        if g.state.snapshot_step == step:
            mine = pack(g.state.committed_own())
        else:  # a step behind the others' (a dump of the step before): its node's record of that step
            mine = g.recorded_own(g.rank, step)
            if mine is None:
                raise CheckpointError(f"rank {g.rank} committed step {g.state.snapshot_step}, not {step}, and "
                                      f"its node holds no record of step {step}")
        return [g.write_own(step, g.rank, mine),
                *carry_records(carry, step, by=g.rank, recorded=g.recorded_own, check=_holds_streams,
                               write=g.write_own)]

    def finalize(self, step: int, shards: Sequence[SavedShard], history: dict,
                 own: Sequence[FileInfo] = ()) -> None:
        self.guard.finalize_checkpoint(step, shards, self.guard.merged_history(history), extra=own)

    def resumed(self, step: int, record: dict, pids: dict | None = None, replicas: int = 0) -> None:
        g = self.guard
        lost = g.replaced_ranks(pids)
        if lost and g.snapshots is not None and g.store is not None:
            # A save in flight that awaits a lost rank's own part: its replacement never writes it.
            g.snapshots.give_up(g.store, [own_file(r) for r in lost],
                                f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
                                "died before writing it and was restarted")
        g.record_resume(record, pids)
        if replicas:
            self.guard.replicas_changed(step, replicas)


def _holds_streams(rank: int, data: bytes, what: str) -> None:
    """A record carried for lost ``rank`` must hold that rank's random streams."""
    if str(rank) not in unpack(data, what).get("rng", {}):
        raise CheckpointError(f"{what} holds no random streams of that rank")


def shard_name(copies: Sequence[int]) -> str:
    return shard_file(0, copies, ".pt")


def read_shard(path) -> dict:
    """Load one verified shard file without unpickling arbitrary objects,
    onto the host: ``load_state_dict`` moves the model and optimizer state
    where they live, and random streams or a data position put on a device
    could not be set again."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} could not be loaded safely: {e}") from None
