"""The MindSpore adapter's recovery handlers and its checkpoint files.

Repair copies every parameter (weights, BatchNorm statistics, optimizer
slots) from a replica: through a file in shared memory (the node's private
snapshot directory when the launcher made one) when the replica and
every rank it repairs share a machine (ResNet-50's 179 MB in about 1.9 s,
where MindSpore's CPU ``Broadcast`` took about 9 s), else, or with
``TRAINGUARD_SHM_REPAIR=0``, with one ``Broadcast`` over the job's world
group. Checkpoints use MindSpore TFT's layout::

    <dir>/ttp_saved_checkpoints-step_{n}_tmp/rank_{r}/ttp_rank_{r}-{epoch}_{step_in_epoch}.ckpt

(epoch and step in it counted from 1, as MindSpore does; the directory named
as MindSpore 2.10's own TFT names it, older releases' ``tft_saved_...`` read too)

written with ``mindspore.save_checkpoint`` (with ``epoch_num``, ``step_num``,
``global_step`` and ``loss_scale`` appended), verified, and renamed without
``_tmp`` by one rank, which writes trainguard's manifest inside.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from trainguard.core import CheckpointError, Processor, RecoveryError, Transfer
from trainguard.core.config import RankConfig
from trainguard.core.checkpoint import FileInfo, SavedShard, Verified
from trainguard.core.rank.recovery import Handlers
from trainguard.core.snapshot.own import carry as carry_records

from .own import pack, unpack
from .state import ModelState

__all__ = ["MindSporeHandlers", "MindSporeRank", "load_checkpoint", "shard_name"]

log = logging.getLogger("trainguard.mindspore")
SHM = "/dev/shm"



def epoch_and_step(step: int, steps_per_epoch: int) -> tuple[int, int]:
    """MindSpore's numbering of the step that completed update ``step``:
    the (1-based) epoch it belongs to and its (1-based) place in it."""
    if not steps_per_epoch or step == 0:
        return 1, step
    return (step - 1) // steps_per_epoch + 1, (step - 1) % steps_per_epoch + 1


def shard_name(rank: int, step: int, steps_per_epoch: int) -> str:
    epoch, in_epoch = epoch_and_step(step, steps_per_epoch)
    return f"rank_{rank}/ttp_rank_{rank}-{epoch}_{in_epoch}.ckpt"


class MindSporeRank(Protocol):
    """What the handlers take from the MindSpore :class:`~.guard.Guard`."""

    rank: int
    world_size: int
    state: ModelState
    processor: Processor
    store: Any  # a CheckpointStore, or None
    snapshots: Any  # its ParamSnapshots, or None
    save_fn: Callable[[int], None] | None
    save_fn_offset: int  # the data position of step 0, for the streams beside save_fn's files
    stream_files: Any  # StreamFiles beside save_fn's files, or None
    steps_per_epoch: int
    pids: dict[int, int]
    hosts: dict[int, int]  # rank -> its machine
    comm_broken: str  # why this process must not run collectives any more
    settings: RankConfig

    def _collective(self, fn: Callable[[], Any], op: str = "collective") -> Any: ...

    def barrier(self) -> None: ...

    def write_snapshot_file(self, step: int) -> FileInfo: ...

    def recorded_own(self, rank: int, step: int) -> bytes | None: ...

    def write_own(self, step: int, rank: int, data: bytes) -> FileInfo: ...

    def merged_history(self, controller: dict) -> dict: ...

    def record_resume(self, record: dict, pids: dict | None) -> None: ...

    def rolled_back(self, step: int) -> None: ...


class MindSporeHandlers(Handlers):
    """Recovery commands carried out on one :class:`~.guard.Guard`'s objects."""

    def __init__(self, guard: MindSporeRank) -> None:
        self.guard = guard
        # Same-machine repairs through shared memory unless TRAINGUARD_SHM_REPAIR=0 (the job's, so every rank's).
        self.shm = guard.settings.shm_repair and os.path.isdir(SHM)
        self._repaired = False

    def clean(self, uce: bool) -> int:
        g = self.guard
        g.state.restore_buffers()  # the abandoned step's forward moved BatchNorm statistics
        self._repaired = False
        return 0

    def rebuild(self, generation: int, ranks: Sequence[int], join_store: str = "") -> None:
        g = self.guard
        if g.comm_broken:
            raise RecoveryError(f"rank {g.rank} cannot communicate any more ({g.comm_broken}); MindSpore's "
                                f"communicator cannot be rebuilt in the process")
        if join_store or sorted(ranks) != list(range(g.world_size)):
            raise RecoveryError("the MindSpore adapter cannot change the group's members (new or dropped ranks)")
        # Nothing to rebuild: every collective of the left step was completed (drained).

    def repair(self, step: int, transfers: Sequence[Transfer]) -> None:
        g = self.guard
        if any(t.kind != 0 for t in transfers):
            raise RecoveryError("the MindSpore adapter holds dense state only")
        receivers = {t.dst: t.src for t in transfers}
        for src in sorted({t.src for t in transfers}):
            if g.rank == src and g.state.snapshot_step != step:
                raise RecoveryError(f"rank {g.rank} is at step {g.state.snapshot_step}, cannot serve step {step}")
            if receivers.get(g.rank) == src:
                g.processor.begin_copy()
            dsts = sorted(d for d, s in receivers.items() if s == src)
            if self.shm and all(g.hosts[d] == g.hosts[src] for d in dsts):
                got = shm_copy(g, g.state, src, dsts, step)
            else:
                got = broadcast_state(g, g.state, src)  # every rank takes part in the broadcast
            if receivers.get(g.rank) == src:
                g.state.load_arrays(got, source=f"rank {src}'s state")
                if g.state.buffers and not g.state.restore_own_buffers(step):
                    log.warning("rank %d holds no buffers of its own at step %d (it committed step %s): it goes on "
                                "with rank %d's (BatchNorm statistics), so the job is no longer bit-identical to a "
                                "fault-free run", g.rank, step, g.state.snapshot_step, src)
                g.processor.end_copy(step)
                self._repaired = True
                log.info("rank %d took its state at step %d from rank %d", g.rank, step, src)

    def rollback(self, step: int) -> None:
        g = self.guard
        if not self._repaired and g.state.snapshot_step != step:
            raise RecoveryError(f"rank {g.rank} committed step {g.state.snapshot_step} and was not repaired; "
                                f"it cannot roll back to step {step}")
        if not g.state.restore_streams(step):  # an abandoned step drew random numbers the retried one draws again
            log.warning("rank %d holds no random streams of step %d (it committed step %s): they go on as they "
                        "are, so the job is no longer bit-identical to a fault-free run", g.rank, step,
                        g.state.snapshot_step)
        g.rolled_back(step)

    def save(self, step: int, kind: int) -> Sequence[FileInfo]:
        g = self.guard
        if kind != 0:
            raise CheckpointError(f"the MindSpore adapter holds dense state only, not kind {kind}")
        if g.store is None and g.save_fn is None:
            raise CheckpointError("no checkpoint_dir was given to the Guard, so there is nowhere to save")
        if g.state.snapshot_step != step:
            raise CheckpointError(f"rank {g.rank} committed step {g.state.snapshot_step}, not {step}")
        g.state.restore_buffers()
        if g.save_fn is not None:
            try:
                g.save_fn(step)
            except Exception as e:  # the controller tries the next strategy
                raise CheckpointError(f"rank {g.rank}: the user's save function failed at step {step}: "
                                      f"{type(e).__name__}: {e}") from e
            log.info("rank %d saved step %d with the user's save function", g.rank, step)
            return []
        return [self.write(step)]

    def write(self, step: int) -> FileInfo:
        """Write this rank's state at ``step`` under the temporary name (from
        its snapshot in memory when the Guard takes snapshots)."""
        g = self.guard
        if g.snapshots is not None:
            return g.write_snapshot_file(step)
        params = [{"name": name, "data": Tensor(a)} for name, a in g.state.arrays().items()]
        extra = {"epoch_num": epoch_and_step(step, g.steps_per_epoch)[0], "step_num": step, "global_step": step,
                 "loss_scale": 1.0}
        extra = {k: v for k, v in extra.items() if k not in g.state.params}  # the optimizer's own global_step wins
        return g.store.write_path(step, shard_name(g.rank, step, g.steps_per_epoch),
                                  lambda path: ms.save_checkpoint(params, str(path), append_dict=extra))

    def save_own(self, step: int, carry: Sequence[int]) -> Sequence[FileInfo]:
        """Write this rank's random streams at ``step`` and those of the lost
        ranks in ``carry`` (their records on this node): into the
        checkpoint, or beside a user save function's files (nothing of
        theirs is finalised, so no files are returned)."""
        g = self.guard
        if g.save_fn is not None and g.stream_files is None:
            return []  # nowhere to write them: the Guard said so before step 0
        if g.save_fn is None and g.store is None:
            raise CheckpointError("no checkpoint_dir was given to the Guard, so there is nowhere to save")
        mine = g.state.streams_at(step)
        data = pack(mine, g.state.buffers_at(step)) if mine is not None else g.recorded_own(g.rank, step)
        if data is None:
            raise CheckpointError(f"rank {g.rank} committed step {g.state.snapshot_step}, not {step}, and its "
                                  f"node holds no record of step {step}")
        check = lambda rank, record, what: unpack(record, what)  # noqa: E731
        if g.save_fn is not None:
            beside = lambda s, rank, record: g.stream_files.write(g.save_fn_offset + s, rank, record)  # noqa: E731
            beside(step, g.rank, data)
            carry_records(carry, step, by=g.rank, recorded=g.recorded_own, check=check, write=beside)
            return []
        return [g.write_own(step, g.rank, data),
                *carry_records(carry, step, by=g.rank, recorded=g.recorded_own, check=check, write=g.write_own)]

    def finalize(self, step: int, shards: Sequence[SavedShard], history: dict,
                 own: Sequence[FileInfo] = ()) -> None:
        g = self.guard
        if g.save_fn is not None:
            log.info("step %d was saved by the user's save function: nothing to rename", step)
            return
        g.store.finalize(step, [f for s in shards for f in s.files] + list(own),
                         layout={"world_size": g.world_size, "shards": [s.describe() for s in shards]},
                         meta={"history": g.merged_history(history), "finalised_by": g.rank})

    def finalize_files(self, step: int, files: Sequence[FileInfo], copies: Sequence[int], history: dict) -> None:
        """Finalise a checkpoint this rank wrote alone (a periodic save of one shard)."""
        shard = SavedShard(kind=0, copies=tuple(copies), full=len(copies) == self.guard.world_size,
                           rank=self.guard.rank, files=tuple(files))
        self.guard.store.finalize(step, list(files), layout={"world_size": self.guard.world_size,
                                                            "shards": [shard.describe()]},
                                  meta={"history": history, "finalised_by": self.guard.rank})

    def resumed(self, step: int, record: dict, pids: dict | None = None, replicas: int = 0) -> None:
        self.guard.record_resume(record, pids)


def shm_copy(guard: MindSporeRank, state: ModelState, root: int, receivers: Sequence[int],
             step: int) -> dict[str, np.ndarray] | None:
    """``root``'s state for the ``receivers``, on the same machine, through
    a file in shared memory; every rank takes part in the two barriers.
    The file is removed by whoever gets to it after both barriers, or when
    one fails."""
    g = guard
    directory = _repair_dir(g.settings.node_dir)
    path = directory / f"trainguard-{g.processor.job_id or 'job'}-{g.pids[root]}-step{step}.state"
    arrays = state.arrays()
    try:
        if g.rank == root:
            _remove_stale(directory)
            path.unlink(missing_ok=True)  # never written through a link planted at its name
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                           "wb") as f:
                for a in arrays.values():
                    f.write(np.ascontiguousarray(a).data)
        g.barrier()  # written
        out = None
        if g.rank in receivers:
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                blob = np.fromfile(f, np.uint8)
            total = sum(a.nbytes for a in arrays.values())
            if blob.size != total:
                raise RecoveryError(f"{path} holds {blob.size} bytes of rank {root}'s state, expected {total}")
            out, offset = {}, 0
            for name, a in arrays.items():
                out[name] = blob[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
                offset += a.nbytes
        g.barrier()  # read
        return out
    finally:
        if g.rank == root or g.rank in receivers:
            path.unlink(missing_ok=True)


def _repair_dir(node_dir: str | None) -> Path:
    """Where a repair's file goes: the node's snapshot directory (private,
    0700, set by the launcher) when there is one, else shared memory itself
    (the file is then created anew, 0600, and never opened through a link)."""
    return Path(node_dir) if node_dir and os.path.isdir(node_dir) else Path(SHM)


def _remove_stale(directory: Path) -> None:
    """Remove state files of ours left by a repair whose source process died
    (another user's files, and links, are left alone)."""
    uid = os.getuid()
    for f in directory.glob("trainguard-*-step*.state"):
        try:
            st = f.lstat()
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            pid = int(f.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("removing %s: its process %d is gone", f, pid)
            f.unlink(missing_ok=True)
        except (ValueError, PermissionError, FileNotFoundError):
            continue


def broadcast_state(guard: MindSporeRank, state: ModelState, root: int) -> dict[str, np.ndarray]:
    """Every parameter of ``root``'s state, on every rank, in one broadcast.

    The arrays' bytes travel as one float32 buffer (MindSpore's CPU
    collectives take floats only); a broadcast copies bytes and computes
    nothing, so integers and every float bit pattern arrive unchanged."""
    arrays = state.arrays()
    blob = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
    blob += b"\0" * (-len(blob) % 4)
    flat = np.frombuffer(blob, np.float32) if guard.rank == root else np.zeros(len(blob) // 4, np.float32)
    got = guard._collective(lambda: ops.Broadcast(root)((Tensor(flat),))[0].asnumpy()).tobytes()
    out, offset = {}, 0
    for name, a in arrays.items():
        out[name] = np.frombuffer(got, a.dtype, a.size, offset).reshape(a.shape).copy()
        offset += a.nbytes
    return out


def load_checkpoint(found: Verified, rank: int, state: ModelState) -> dict:
    """Load ``rank``'s shard of a verified checkpoint into ``state``; return
    the job's history stored with it."""
    shards = found.manifest.get("layout", {}).get("shards", [])
    mine = next((s for s in shards if s["kind"] == 0 and (s["full"] or rank in s["copies"])), None)
    if mine is None:
        raise CheckpointError(f"{found.path} holds no shard for rank {rank} (saved with world size "
                              f"{found.manifest.get('layout', {}).get('world_size')})")
    # The bytes verified, whatever is at the name now (MindSpore wants a .ckpt name: a link to the descriptor).
    with found.open(mine["files"][0]) as path, path.named() as name:
        try:
            loaded = ms.load_checkpoint(name)
        except Exception as e:
            raise CheckpointError(f"{path} could not be loaded: {e}") from None
    arrays = {k: v.asnumpy() for k, v in loaded.items() if k in state.params}
    try:
        state.load_arrays(arrays, source=str(path))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return found.manifest.get("meta", {}).get("history", {"records": [], "pids": {}})
