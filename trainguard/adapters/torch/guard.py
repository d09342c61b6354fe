"""``Guard``: protect an ordinary PyTorch training loop.

::

    dist.init_process_group("gloo")
    model = DDP(net)
    guard = Guard(model, torch.optim.AdamW(model.parameters()), scheduler=sched,
                  checkpoint_dir="ckpt", save_every=100)
    for step in guard.steps(10_000):          # resumes where the checkpoint left off
        with guard.protect():                 # a fault here is recovered, not raised
            x, y = batch(step)
            loss = F.cross_entropy(model(x), y)
            guard.optimizer.zero_grad()
            loss.backward()
            guard.optimizer.step()
            sched.step()
    guard.close()

One iteration of the loop is one training step (put gradient accumulation
inside the body). ``steps`` yields the number of completed steps; after a
recovery it yields the step that failed again. Launched with ``trainguard
run`` the guard connects to the job's controller; launched any other way it
still checkpoints and resumes, but cannot recover in place.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainguard.core import (
    CheckpointStore,
    Classifier,
    ConfigError,
    DataStatus,
    FaultInjector,
    Processor,
    RankConfig,
    ReplicaGroup,
    recover,
    report_left_step,
)
from trainguard.core import logs
from trainguard.core.compile_cache import resolve_root
from trainguard.core.rank import RankRuntime
from trainguard.core.preflight import check_checkpoint_dir
from trainguard.core.profiling import recorder_from_env
from trainguard.core.rehearsal import Rehearsal

from .checkpoints import Checkpoints
from .comm import TorchComm, job_namespace
from .compile_cache import TorchCompileCache, key_parts
from .device import for_module
from .fsdp import MeshGroups
from .handlers import TorchHandlers
from .injection import fault_hooks
from .join import joining
from .markers import TorchMarkers
from .optimizer import GuardedOptimizer
from .own import fingerprints
from .probes import ThreadProbes
from .process_group import AbortableProcessGroup
from .sharding import refuse_different_models, sharding_of, structure
from .state import state_sha256
from .trainstate import TrainState
from .update import UpdateBracket

__all__ = ["Guard"]

log = logging.getLogger("trainguard.torch")


class Guard(Checkpoints, RankRuntime):
    """Fault tolerance for one training loop.

    Args:
        model: the module being trained; a ``DistributedDataParallel`` is
            switched onto trainguard's process group and comm hook.
        optimizer: any ``torch.optim.Optimizer``; use :attr:`optimizer`
            (the wrapped one) in the loop.
        scheduler, scaler: LR scheduler and ``GradScaler`` (optional).
        data: an object with ``state_dict``/``load_state_dict`` holding the
            data position (optional; not needed when batches are a function
            of the step).
        extra: more named stateful objects to save and repair.
        checkpoint_dir: where periodic and dying-gasp checkpoints go; the
            newest complete one is loaded at start.
        save_every: periodic checkpoint interval in steps (0: none).
        keep: complete checkpoints kept (0: all).
        snapshot_every: copy the state into shared memory every this many
            steps (0: never). The copy of host state runs beside the next
            step, whose optimizer update waits for it; periodic saves are
            written by a persist worker in the background. A restarted
            process loads from memory when every rank can.
        snapshots_in_memory: snapshot slots per rank (each the size of the
            state: 12 bytes per parameter with fp32 Adam).
        snapshot_peer: keep a copy of each snapshot on the next node
            (``trainguard run`` with several nodes).
        snapshot_shared: the data-parallel replicas on a node share one
            snapshot of their state: the lowest copies it, the others only
            their random streams (memory and copying per node instead of per
            rank; not with ``snapshot_peer``).
        profiling_dir: where per-rank profiling markers go, switched at run
            time by a JSON file (default: ``TRAINGUARD_PROFILING_DIR``;
            unset: no markers; see :mod:`trainguard.core.profiling`).
        replicas: this rank's replica groups (default: every rank holds the
            whole state, as in DDP).
        processor, injector, classifier: collaborators, from the
            environment when omitted.
        comm_timeout: the inner backend's own timeout.
        elastic_lr: what elastic-training does to the learning rate while the
            job runs with fewer data-parallel replicas (each keeps its batch
            size, so the global batch shrinks with them): ``"keep"`` it, or
            ``"linear"``: scale it by replicas / world size (the linear
            scaling rule), back to 1 when the job is whole again.
        compile_cache: where torch.compile's artifacts are kept for
            restarted and relaunched processes, on storage every rank
            reaches (default: ``TRAINGUARD_COMPILE_CACHE``, else
            ``<checkpoint_dir>/.trainguard/compile_cache``; ``False``: none).
            Create the Guard before the compiled model's first call.
        compile_cache_key: more that the compiled graphs depend on (input
            shapes, compile options), as JSON values; see
            :mod:`trainguard.adapters.torch.compile_cache`.
        start_step: the step the model and optimizer are at when the Guard
            finds no checkpoint of its own at or after it (the script
            loaded a checkpoint of its own, e.g. with DCP); the same on
            every rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any = None,
        scaler: Any = None,
        data: Any = None,
        extra: Mapping[str, Any] | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        save_every: int = 0,
        snapshot_every: int = 0,
        snapshots_in_memory: int = 2,
        snapshot_peer: bool = False,
        snapshot_shared: bool = False,
        keep: int = 2,
        replicas: Sequence[ReplicaGroup] | None = None,
        processor: Processor | None = None,
        injector: FaultInjector | None = None,
        classifier: Classifier | None = None,
        comm_timeout: timedelta = timedelta(minutes=30),
        elastic_lr: str = "keep",
        profiling_dir: str | os.PathLike | None = None,
        compile_cache: str | os.PathLike | bool | None = None,
        compile_cache_key: Mapping[str, Any] | None = None,
        start_step: int = 0,
    ) -> None:
        if not dist.is_initialized():
            raise ConfigError("call torch.distributed.init_process_group() before creating a Guard")
        if isinstance(optimizer, GuardedOptimizer):
            raise ConfigError("pass the plain optimizer; the Guard wraps it (use guard.optimizer)")
        if elastic_lr not in ("keep", "linear"):
            raise ConfigError(f"elastic_lr must be 'keep' or 'linear', got {elastic_lr!r}")
        if save_every < 0 or (save_every and checkpoint_dir is None):
            raise ConfigError("save_every needs a checkpoint_dir and must be >= 0")
        if start_step < 0:
            raise ConfigError(f"start_step must be >= 0, got {start_step}")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sharding = sharding_of(model, optimizer, self.world_size)  # FSDP2/HSDP, or None; the rest refused
        logs.setup(f"rank {self.rank}")
        self.settings = RankConfig.from_env()
        self.device = for_module(model)
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.state = TrainState(model, optimizer, scheduler=scheduler, scaler=scaler, data=data, extra=extra,
                                rank=self.rank, sharded=self.sharding is not None)
        self._update = UpdateBracket(self, optimizer, scaler, self.state.host.get("data"))
        self.optimizer = self._update.optimizer
        self.groups = tuple(replicas) if replicas else (ReplicaGroup.full(range(self.world_size)),)
        if self.sharding is not None:
            if replicas and tuple(replicas) != (self.sharding.replicas,):
                raise ConfigError(f"replicas= does not describe this {self.sharding.kind} model's device mesh; leave it "
                                  "out (the Guard reads the layout from the mesh)")
            self.groups = (self.sharding.replicas,)
        self.start_step = start_step
        self.rehearsal = Rehearsal.from_env(self.rank)
        if self.rehearsal is not None and checkpoint_dir is not None:
            checkpoint_dir = self.rehearsal.checkpoint_dir(checkpoint_dir)
        self.store = CheckpointStore(checkpoint_dir, keep=keep) if checkpoint_dir is not None else None
        self.save_every = save_every
        self.classifier = classifier or Classifier()
        self.records: list[dict] = []
        self.history: dict = {"records": [], "pids": {}}
        self.elastic_lr = elastic_lr
        self.replicas: list[dict] = [{"step": 0, "replicas": self.world_size}]  # data-parallel width over time
        self._handlers = TorchHandlers(self)
        self._step = 0
        self._entered = False
        self._step_started = 0.0
        self._hooks: list[Any] = []
        join = joining(self.settings.join)
        self.replacement = join is not None  # until its history came from a replica
        cache_root = resolve_root(compile_cache, checkpoint_dir)
        self.compile_cache = TorchCompileCache(
            cache_root, key_parts(model, self.device.torch_device, compile_cache_key) if cache_root else {},
            warn=self.rank == 0 or join is not None, owner=f"rank {self.rank}")

        # Checked alike on every rank before its first collective: none waits for a rank that refused.
        log_path = Path(checkpoint_dir) / ".trainguard" / "faults.jsonl" if checkpoint_dir is not None else \
            self.rehearsal.fault_log() if self.rehearsal is not None else None  # a fault strikes once per job
        self.injector = injector or FaultInjector(self.settings.faults, self.rank, world_size=self.world_size,
                                                  log_path=log_path)
        self.injector.refuse("phase=reduce is the MindSpore Guard's (DDP reduces inside the backward pass: inject "
                             "phase=backward)", phases=("reduce",))
        if checkpoint_dir is not None:
            check_checkpoint_dir(checkpoint_dir)
        self.comm = TorchComm(self.rank, self.world_size, self.device, self.ddp, timeout=comm_timeout,
                              namespace=job_namespace(self.settings),
                              generation=join["generation"] if join else 0,
                              first_bucket=self._record_own_before_sending, route_default=self.sharding is None)
        self.mesh_groups = MeshGroups(self.sharding, self.rank, self.world_size, self.device, timeout=comm_timeout,
                                      namespace=job_namespace(self.settings), generation=join["generation"] if join
                                      else 0, first_reduce=self._record_own_before_sending) if self.sharding else None
        self._setup_snapshots(snapshot_every, snapshots_in_memory, snapshot_peer, snapshot_shared)
        self._setup_own_records()
        started_at = time.time()
        if join:
            # The others are paused in a recovery: no start-up collectives;
            # the state, the step and the history come from a replica.
            self.pids = {self.rank: os.getpid()}
        else:
            ids = self.process_group.all_gather_json([os.getpid(), started_at, start_step, structure(model)],
                                                     self.device.torch_device)
            if len({s for _, _, s, _ in ids}) > 1:
                raise ConfigError(f"the ranks were given different start_step values: {[i[2] for i in ids][:16]}")
            if not replicas:  # replicas= says which ranks hold the same state
                refuse_different_models([i[3] for i in ids])
            self.pids = {r: pid for r, (pid, _, _, _) in enumerate(ids)}
            started_at = ids[0][1]  # one default profiling job id for every rank
            self._step = self._load()
        self.state.commit(self._step)
        self.recorder = recorder_from_env(rank=self.rank, started_at=started_at, directory=profiling_dir)
        self._markers = TorchMarkers(self.recorder, [self.state.module], lambda: self._step,
                                     lambda: [g for g in (self.process_group, self.comm.default_group) if g is not None]
                                     ) if self.recorder else None

        self.injector.on_stall = self._black_hole
        self._hooks.extend(fault_hooks(self.state.module, self.injector, self.sharding, lambda: self._step))
        self.processor = processor or self._connect(joining=join is not None)
        self.processor.add_stop_listener(self.comm.stop)
        if self.mesh_groups is not None:
            self.processor.add_stop_listener(self.mesh_groups.stop)
        probes = ThreadProbes(threading.get_ident(), lambda: self.comm.busy or (
            self.mesh_groups is not None and self.mesh_groups.busy))
        self.processor.watchdog.in_collective = probes.blocked_on_comm
        self.processor.watchdog.in_pause = probes.waiting_for_loader
        self.processor.watchdog.where = probes.where
        self._exit_code: int | None = None
        atexit.register(self._exit_now)
        if join:
            self._join(join["step"])

    def _join(self, step: int) -> None:
        """A replacement process: take part in the recovery that started it
        (repair from a replica, roll back to ``step``) before training."""
        log.info("rank %d (pid %d) joins the running job at step %d", self.rank, os.getpid(), step)
        self.injector.strike("resume", step)
        self.processor.watchdog.disarm()
        outcome = recover(self.processor, self._handlers, injector=self.injector)
        if not outcome.resume:
            self._leave(outcome)

    # --------------------------------------------------------------- setup
    def _connect_details(self) -> dict:
        return {"device": self.device.name, "device_repairable": self.device.repairable,
                "restart_count": self.settings.restart_count,
                **({"join_refused": self.sharding.join_refused} if self.sharding is not None else {})}

    @property
    def process_group(self) -> AbortableProcessGroup:
        """The group the step's collectives run on now (see :class:`.comm.TorchComm`)."""
        return self.comm.process_group

    def _black_hole(self) -> None:
        """Fault injection (``stall``): the groups in use then stop sending."""
        for group in [self.process_group, *(self.mesh_groups.groups if self.mesh_groups is not None else ())]:
            group.black_hole()

    # ----------------------------------------------------------- the loop
    # The step API's torch side (begin_step, end_step, fail_step: RankRuntime); the optimizer update is
    # bracketed by self._update (.update).
    def _begin(self) -> None:
        self.injector.strike("gc", self._step)
        self._entered = True
        self._update.reset()
        self._step_started = time.perf_counter()
        self.comm.arm()
        if self.mesh_groups is not None:
            self.mesh_groups.arm()

    def _commit(self) -> None:
        self._update.finish()
        self.processor.end_update(self._step + 1)
        self._step += 1
        self._update.reset()
        self.state.commit(self._step)
        if self.own_records is not None and self.state.streams_moved():  # drawn after the update began
            self._record_own(self._step, self.state.committed_own())
        if self.ddp is not None:
            self.comm.keep_bucket_layout()
        self._after_commit()

    def _snapshot_after_step(self) -> None:
        self.take_snapshot(self._step, background=True)  # settled at the next update

    def _fingerprints(self) -> dict:
        return fingerprints(self.state.module, self.state.committed_own(), self.rank, self._pieces())

    def _pieces(self) -> dict:
        """What a rehearsal compares besides the model and the own part:
        the optimizer, the learning rates, the scheduler, the scaler (one
        found stepping but not given too) and each extra, as committed."""
        return self._update.pieces(self.state.pieces())

    def _loop_ran(self, frame) -> None:
        self._update.loop_ran(frame)

    def _handle(self, error: BaseException) -> None:
        """Report why the step was left and carry out the recovery."""
        self._settle_snapshot()  # before a repair or a dump touches the state or the slots
        phase = "optimizer" if self.processor.data is DataStatus.UPDATING else "step"
        report_left_step(self.processor, error, self.classifier, phase=phase)  # logs it too
        self._recover(error)

    def _exit(self, code: int) -> None:
        self._exit_code = code
        raise SystemExit(code)

    def _exit_now(self) -> None:
        """At interpreter exit after the controller's exit command (the
        script's own ``finally`` blocks and later ``atexit`` handlers have
        run): end the process without destroying the process groups, whose
        destructors can abort the process when a peer is gone (gloo throws
        from a destructor) or block on it."""
        if self._exit_code is not None:
            logs.exit_now(self._exit_code)

    def replicas_changed(self, step: int, replicas: int) -> None:
        """Training continues at ``step`` with ``replicas`` data-parallel replicas."""
        if replicas != self.replicas[-1]["replicas"]:
            self.replicas.append({"step": step, "replicas": replicas})
        if self.elastic_lr == "linear":
            self.optimizer.lr_factor = replicas / self.world_size

    def _reset_step(self) -> None:
        self._update.reset()

    # ------------------------------------------------------------- report
    def _state_sha256(self) -> str:
        return state_sha256(self.state.model_and_optimizer())

    def _report_extras(self) -> dict:
        # as fingerprints at the last commit: this rank's random streams and data position (own), and the rest
        # of the state (learning rates, scheduler, scaler, extras; the model and optimizer: final_state_sha256)
        pieces = {k: v for k, v in self._pieces().items() if k != "optimizer"}
        found = fingerprints(self.state.module, self.state.committed_own(), self.rank, pieces)
        own = ("rng", "python", "numpy", "data")
        return {"replicas": list(self.replicas), "own_fingerprints": {k: found[k] for k in own},
                "piece_fingerprints": {k: v for k, v in found.items() if k not in own and k != "model"}}

    def _final_extras(self) -> dict:
        return {"data_given": "data" in self.state.host, "given": sorted(self.state.host),
                "undeclared": self._update.found,
                **fingerprints(self.state.module, self.state.own_part(), self.rank, self._pieces())}

    def _close_snapshots(self, finished: bool) -> None:
        super()._close_snapshots(finished)
        if self.own_records is not None:
            self.own_records.close()


