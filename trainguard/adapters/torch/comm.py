"""The torch Guard's communication: trainguard's abortable process group,
and DDP kept on it.

:class:`TorchComm` owns the group the training step's collectives run on.
A recovery rebuilds it in place, replaces it by one over other ranks
(elastic training, :meth:`TorchComm.regroup`) or, after survivors met a new
process (:func:`.join.meet`), rebuilds it on the join's store; DDP's comm
hook follows the group in use through a :class:`GroupRef`, and tells the
Guard when a step's first gradient bucket leaves. The default group is made
abortable too (:mod:`.default_group`): a STOP releases the collectives a
framework runs there, and a recovery rebuilds it beside trainguard's.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from trainguard.core import ConfigError, RankConfig

from .default_group import route
from .device import Device
from .process_group import AbortableProcessGroup

__all__ = ["GroupRef", "TorchComm", "allreduce_hook", "job_namespace"]

log = logging.getLogger("trainguard.torch")


class TorchComm:
    """The Guard's process group and DDP on it.

    Args:
        rank, world_size: this process's place in the job.
        device: where the model lives (it builds and aborts the backend).
        ddp: the ``DistributedDataParallel`` being trained, or ``None``.
        timeout: the inner backend's own timeout.
        namespace: the groups' store prefix (:func:`job_namespace`).
        generation: the group's generation (a joining process's is the
            recovery's that started it).
        first_bucket: called once per :meth:`arm`, before DDP sends that
            step's first gradient bucket.
        route_default: put an abortable group in the default group's place
            (:mod:`.default_group`). ``False`` for a sharded model: its
            device mesh may be built on the default group itself (a 1-D
            mesh over the world), and DTensor looks that group up by
            object, so it stays; the mesh's groups are made abortable by
            :class:`~.fsdp.MeshGroups` instead.

    Raises:
        ConfigError: ``ddp`` has a comm hook of its own already.
    """

    def __init__(self, rank: int, world_size: int, device: Device, ddp: Any, *, timeout: timedelta, namespace: str,
                 generation: int = 0, first_bucket: Callable[[], None] | None = None,
                 route_default: bool = True) -> None:
        self.rank, self.world_size, self.device, self.ddp = rank, world_size, device, ddp
        self.namespace = namespace
        self.joined_default_group: Any = None  # kept alive after survivors met a new process
        self.process_group = AbortableProcessGroup(
            dist.distributed_c10d._get_default_store(), rank, world_size, backend_factory=device.backend,
            timeout=timeout, namespace=namespace, abort=device.abort, generation=generation)
        # Built second on every rank, a joining process included (the survivors rebuild in this order).
        self.default_group, self._started_on = route(lambda store: AbortableProcessGroup(
            store, rank, world_size, backend_factory=device.backend, timeout=timeout,
            namespace=f"{namespace}/default", abort=device.abort, generation=generation)) if route_default \
            else (None, None)
        if ddp is not None:
            try:
                self._hook_group = GroupRef(self.process_group, first_bucket)
                ddp.register_comm_hook(self._hook_group, allreduce_hook)
            except RuntimeError as e:
                raise ConfigError(f"trainguard installs its own DDP comm hook and found one already: {e}") from None
            self.attach_ddp()

    def stop(self, reason: str = "stopped by the controller") -> None:
        """Release every collective waiting on a peer, in trainguard's group
        and in the default group (safe from any thread)."""
        self.process_group.stop(reason)
        if self.default_group is not None:
            self.default_group.stop(reason)

    @property
    def busy(self) -> bool:
        """Whether a collective is in flight on either group."""
        return self.process_group.busy or (self.default_group is not None and self.default_group.busy)

    def rebuild(self, generation: int, cancelled: Callable[[], bool], store: Any = None) -> None:
        """Fresh backends for ``generation`` under both groups (every rank calls
        this with the same number), on ``store`` when given (a join's)."""
        self.process_group.rebuild(generation, cancelled=cancelled, store=store)
        self._rebuild_default(generation, cancelled, store)

    def _rebuild_default(self, generation: int, cancelled: Callable[[], bool], store: Any = None) -> None:
        group = self.default_group
        if group is None or len(self.process_group.members) != self.world_size:
            return  # while elastic training left ranks out it stays stopped (it spans them)
        group.rebuild(generation, cancelled, store, quiet=True)

    def arm(self) -> None:
        """A step begins: call ``first_bucket`` before its first gradient bucket leaves."""
        if self.ddp is not None:
            self._hook_group.arm()

    def attach_ddp(self) -> None:
        """Point DDP at the (possibly rebuilt) process group, with the
        reducer's per-step state reset after an abandoned step."""
        self.ddp._update_process_group(self.process_group)
        self.keep_bucket_layout()

    def keep_bucket_layout(self) -> None:
        """Keep DDP's initial gradient-bucket layout for the whole job.

        DDP runs its first iteration with buckets in reverse registration
        order, then rebuilds them in the order gradients became ready. Where
        an element sits in a bucket decides the order in which the ranks'
        values are summed, so a process that starts at step n (a relaunch)
        would round its first step differently from one that never stopped.
        Dropping the parameters the reducer collected for a rebuild (before
        the next forward, which would rebuild) keeps one layout -- DDP's own
        initial guess -- in every process. The same holds for a replacement
        process that joins a running job: were the survivors on a rebuilt
        layout, its buckets would hold other parameters than theirs. It costs
        some overlap of communication with the backward pass.
        """
        if self.world_size > 1:
            self.ddp.reducer._reset_state()

    def regroup(self, ranks: Sequence[int], generation: int, cancelled: Callable[[], bool],
                store: Any = None) -> None:
        """Go on with ``ranks`` (elastic training: fewer, or all again): a
        new group over them, on ``store`` when given, with DDP moved onto it."""
        old = self.process_group
        new = AbortableProcessGroup(
            store if store is not None else old._store, self.rank, self.world_size,
            backend_factory=self.device.backend, timeout=old.timeout, namespace=self.namespace,
            abort=self.device.abort, generation=generation, members=ranks, build=False)
        new.rebuild(generation, cancelled=cancelled)
        old.stop("replaced by a group of other ranks")
        old.replace_backend(None)
        self.process_group = new
        if self.default_group is not None:
            if len(ranks) == self.world_size:  # the job is whole again
                self._rebuild_default(generation, cancelled, store)
            else:  # it spans the lost ranks: a collective there would wait for them, so it refuses
                self.default_group.stop("the job goes on without some ranks (elastic training)")
        if self.ddp is not None:
            self._hook_group.group = new
            self.attach_ddp()
        log.warning("rank %d goes on with ranks %s", self.rank, list(ranks)[:16])


class GroupRef:
    """The group a comm hook averages over; elastic training points it at a
    group of fewer ranks (DDP keeps the hook's state object for good).

    ``first_bucket``, when given, is called once per :meth:`arm` (once per
    step), before the step's first gradient bucket is sent: the last moment
    this rank's gradients are its own."""

    def __init__(self, group: AbortableProcessGroup, first_bucket: Callable[[], None] | None = None) -> None:
        self.group = group
        self.first_bucket = first_bucket
        self.armed = False

    def arm(self) -> None:
        self.armed = self.first_bucket is not None

    def sending(self) -> None:
        if self.armed:
            self.armed = False
            self.first_bucket()


def allreduce_hook(state, bucket):  # no annotations: DDP compares them to real types
    """DDP comm hook: average the bucket over ``state`` (an
    :class:`AbortableProcessGroup`, or a :class:`GroupRef` to one) through a
    future trainguard can fail; the same arithmetic as DDP's default hook."""
    if isinstance(state, GroupRef):
        state.sending()
        group = state.group
    else:
        group = state
    tensor = bucket.buffer()
    tensor.div_(group.size())
    return group.allreduce([tensor]).get_future().then(lambda fut: fut.value()[0])


def job_namespace(settings: RankConfig) -> str:
    """A store prefix unique to this launch of the job. Under ``trainguard
    run`` each round of workers gets a fresh store, named by the agent
    (:attr:`~trainguard.core.RankConfig.store_round`: the same on every
    node, also on one that replaced a lost node and counts its restarts
    from 0); under plain torchrun the restarts reuse one store, so the
    restart count names it."""
    round_ = settings.store_round if settings.store_round is not None else settings.restart_count
    return f"trainguard/{settings.run_id}/{round_}"
