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
import sys
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainguard.core import (
    CheckpointStore,
    Classifier,
    ConfigError,
    ControllerLostError,
    DataStatus,
    FaultInjector,
    ForceStop,
    Processor,
    ProcessorConfig,
    ReplicaGroup,
    recover,
    report_left_step,
)
from trainguard.core import logs
from trainguard.core.compile_cache import resolve_root
from trainguard.core.history import Protected
from trainguard.core.preflight import check_checkpoint_dir
from trainguard.core.profiling import recorder_from_env
from trainguard.core.rehearsal import Rehearsal

from .checkpoints import Checkpoints
from .compile_cache import TorchCompileCache, key_parts
from .device import for_module
from .handlers import TorchHandlers
from .join import joining
from .markers import TorchMarkers
from .optimizer import GuardedOptimizer
from .own import fingerprints
from .process_group import AbortableProcessGroup, GroupRef, allreduce_hook, job_namespace
from .state import state_sha256
from .trainstate import TrainState

__all__ = ["Guard"]

log = logging.getLogger("trainguard.torch")


class Guard(Checkpoints):
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
    ) -> None:
        if not dist.is_initialized():
            raise ConfigError("call torch.distributed.init_process_group() before creating a Guard")
        if isinstance(optimizer, GuardedOptimizer):
            raise ConfigError("pass the plain optimizer; the Guard wraps it (use guard.optimizer)")
        if elastic_lr not in ("keep", "linear"):
            raise ConfigError(f"elastic_lr must be 'keep' or 'linear', got {elastic_lr!r}")
        if save_every < 0 or (save_every and checkpoint_dir is None):
            raise ConfigError("save_every needs a checkpoint_dir and must be >= 0")
        _refuse_unsupported(model)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        logs.setup(f"rank {self.rank}")
        self.device = for_module(model)
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.state = TrainState(model, optimizer, scheduler=scheduler, scaler=scaler, data=data, extra=extra,
                                rank=self.rank)
        self.optimizer = GuardedOptimizer(optimizer, self._start_update, self._end_update)
        self.groups = tuple(replicas) if replicas else (ReplicaGroup.full(range(self.world_size)),)
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
        self._updated = False
        self._entered = False
        self._step_started = 0.0
        self._hooks: list[Any] = []
        self.joined_default_group: Any = None  # kept alive after survivors met a new process
        join = joining()
        self.replacement = join is not None  # until its history came from a replica
        cache_root = resolve_root(compile_cache, checkpoint_dir)
        self.compile_cache = TorchCompileCache(
            cache_root, key_parts(model, self.device.torch_device, compile_cache_key) if cache_root else {},
            warn=self.rank == 0 or join is not None, owner=f"rank {self.rank}")

        # Checked alike on every rank before its first collective: none waits for a rank that refused.
        log_path = Path(checkpoint_dir) / ".trainguard" / "faults.jsonl" if checkpoint_dir is not None else \
            self.rehearsal.fault_log() if self.rehearsal is not None else None  # a fault strikes once per job
        self.injector = injector or FaultInjector.from_env(self.rank, world_size=self.world_size, log_path=log_path)
        self.injector.refuse("phase=reduce is the MindSpore Guard's (DDP reduces inside the backward pass: inject "
                             "phase=backward)", phases=("reduce",))
        if checkpoint_dir is not None:
            check_checkpoint_dir(checkpoint_dir)
        self.process_group = AbortableProcessGroup(
            dist.distributed_c10d._get_default_store(), self.rank, self.world_size,
            backend_factory=self.device.backend, timeout=comm_timeout, namespace=job_namespace(),
            abort=self.device.abort, generation=join["generation"] if join else 0)
        if self.ddp is not None:
            try:
                self._hook_group = GroupRef(self.process_group)
                self.ddp.register_comm_hook(self._hook_group, allreduce_hook)
            except RuntimeError as e:
                raise ConfigError(f"trainguard installs its own DDP comm hook and found one already: {e}") from None
            self.attach_ddp()
        self.setup_snapshots(snapshot_every, snapshots_in_memory, snapshot_peer, snapshot_shared)
        self.setup_own_records()
        started_at = time.time()
        if join:
            # The others are paused in a recovery: no start-up collectives;
            # the state, the step and the history come from a replica.
            self.pids = {self.rank: os.getpid()}
        else:
            ids = self.process_group.all_gather_json([os.getpid(), started_at], self.device.torch_device)
            self.pids = {r: pid for r, (pid, _) in enumerate(ids)}
            started_at = ids[0][1]  # one default profiling job id for every rank
            self._step = self._load()
        self.state.commit(self._step)
        self.recorder = recorder_from_env(rank=self.rank, started_at=started_at, directory=profiling_dir)
        self._markers = TorchMarkers(self.recorder, [self.state.module], lambda: self._step,
                                     lambda: self.process_group) if self.recorder else None

        self.injector.on_stall = lambda: self.process_group.black_hole()  # the group in use then
        self._install_fault_hooks()
        self.processor = processor or self._connect(joining=join is not None)
        self.processor.add_stop_listener(lambda: self.process_group.stop())
        self._thread = threading.get_ident()
        self.processor.watchdog.in_collective = self._blocked_on_comm
        self._exit_code: int | None = None
        atexit.register(self._exit_now)
        if join:
            self._join(join["step"])

    def _join(self, step: int) -> None:
        """A replacement process: take part in the recovery that started it
        (repair from a replica, roll back to ``step``) before training."""
        log.warning("rank %d (pid %d) joins the running job at step %d", self.rank, os.getpid(), step)
        self.injector.strike("resume", step)
        self.processor.watchdog.disarm()
        outcome = recover(self.processor, self._handlers, injector=self.injector)
        if not outcome.resume:
            self._leave(outcome)

    # --------------------------------------------------------------- setup
    def _connect(self, *, joining: bool = False) -> Processor:
        config = ProcessorConfig.from_env(rank=self.rank, world_size=self.world_size)
        if config is None:
            if joining:
                raise ConfigError("a replacement process (TRAINGUARD_JOIN set) needs the controller's address")
            if self.rank == 0:
                log.warning("no trainguard controller in this job (TRAINGUARD_CONTROLLER unset): checkpoints "
                            "work, but faults will not be recovered; launch with `trainguard run`")
            processor = Processor(None, rank=self.rank)
            processor.step = self._step
            return processor
        processor = Processor(config)
        processor.connect(step=self._step, replicas=self.groups, device=self.device.name,
                          device_repairable=self.device.repairable,
                          restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), joining=joining)
        return processor

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

    def _install_fault_hooks(self) -> None:
        module = self.state.module
        if self.injector.wants("forward"):
            self._hooks.append(module.register_forward_pre_hook(
                lambda mod, args: self.injector.strike("forward", self._step)))
        if self.injector.wants("backward"):
            params = [p for p in module.parameters() if p.requires_grad]
            middle = params[len(params) // 2]  # mid-backward: some buckets already reduced

            def hook(grad: torch.Tensor) -> torch.Tensor:
                self.injector.strike("backward", self._step)
                return grad

            self._hooks.append(middle.register_hook(hook))

    def _blocked_on_comm(self) -> bool:
        """For the watchdog (called on the processor's thread): is the
        training thread waiting on communication? Collectives are in flight
        and its innermost Python frame is in torch or in our group's wait
        (``backward`` waiting for DDP's buckets, ``Work.wait``), not in the
        training script."""
        if not self.process_group.busy:
            return False
        frame = sys._current_frames().get(self._thread)
        return frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS)

    def section(self, name: str) -> AbstractContextManager:
        """Mark a stretch that may take much longer than a step (evaluation,
        a save of your own) so neither hang check (watchdog, heartbeats) counts
        it; its limit is three times its longest run so far (600 s the first time)::

            with guard.section("evaluation"):
                evaluate(model)
        """
        return self.processor.watchdog.section(name)

    # ----------------------------------------------------------- the loop
    @property
    def step(self) -> int:
        """Completed steps."""
        return self._step

    def steps(self, total: int) -> Iterator[int]:
        """Yield the number of completed steps until ``total`` are done."""
        while self._step < total:
            if self.processor.stop_event.is_set():
                self._handle(ForceStop("stopped at a step boundary"))
                continue
            self._entered = False
            if self._markers is not None:
                self._markers.iteration_start()
            yield self._step
            if not self._entered:
                raise ConfigError("wrap the body of `for step in guard.steps(...)` in `with guard.protect():`")

    def loader(self, iterable: Iterable) -> Iterator:
        """Iterate ``iterable`` (a DataLoader), timing each batch fetch as the
        DataLoader marker when profiling is on::

            batches = guard.loader(train_loader)
            for step in guard.steps(total):
                with guard.protect():
                    x, y = next(batches)
        """
        return self._markers.loader(iterable) if self._markers is not None else iter(iterable)

    def loading(self) -> AbstractContextManager:
        """Time a batch fetch made by a function of the step as the
        DataLoader marker (``with guard.loading(): x, y = batch(step)``)."""
        return self._markers.loading() if self._markers is not None else nullcontext()

    def protect(self) -> Protected:
        """Context manager around one step's body; see the module docstring."""
        return Protected(self)

    def _begin(self) -> None:
        self.injector.strike("gc", self._step)
        self._entered = True
        self._updated = False
        self._step_started = time.perf_counter()

    def _start_update(self) -> None:
        self.settle_snapshot()  # a snapshot copy of the last step may still be reading parameters
        if self.own_records is not None:  # the step drew its random numbers and batch
            self.record_own(self._step + 1, self.state.own_part())
        if self.ddp is not None and self.ddp.will_sync_module_buffers():
            # Make buffers (BatchNorm statistics) identical on every replica
            # before the update, so any replica can serve or save the step.
            self.ddp._sync_buffers()
        self.processor.start_update()

    def _end_update(self) -> None:
        self.injector.strike("optimizer", self._step)
        self._updated = True

    def _commit(self) -> None:
        if not self._updated:  # no optimizer step in this iteration (e.g. GradScaler skipped it)
            self._start_update()
        self.processor.end_update(self._step + 1)
        self._step += 1
        self._updated = False
        self.state.commit(self._step)
        if self.own_records is not None and self.state.streams_moved():  # drawn after the update began
            self.record_own(self._step, self.state.committed_own())
        if self.rehearsal is not None:
            self.rehearsal.step(self._step, fingerprints(self.state.module, self.state.committed_own(), self.rank))
        if self.ddp is not None:
            self.keep_bucket_layout()
        self.compile_cache.after_step()
        self.injector.after_step(self._step, time.perf_counter() - self._step_started)
        if self.save_every and self._step % self.save_every == 0:
            if self._markers is not None:
                with self._markers.save():
                    self.save()
            else:
                self.save()
        elif self.snapshot_every and self._step % self.snapshot_every == 0:
            self.take_snapshot(self._step, background=True)  # settled at the next update
        if self._markers is not None:
            self._markers.step_end()

    def _handle(self, error: BaseException) -> None:
        """Report why the step was left and carry out the recovery."""
        self.settle_snapshot()  # before a repair or a dump touches the state or the slots
        phase = "optimizer" if self.processor.data is DataStatus.UPDATING else "step"
        report_left_step(self.processor, error, self.classifier, phase=phase)  # logs it too
        try:
            outcome = recover(self.processor, self._handlers, injector=self.injector)
        except ControllerLostError as lost:
            raise error from lost
        if not outcome.resume:
            self._leave(outcome)

    def _leave(self, outcome) -> None:
        """The controller said exit: say so, close, and leave with its code."""
        log.info("rank %d exits with code %d: %s", self.rank, outcome.exit_code, outcome.reason)
        self.close(finished=False)
        self._exit_code = outcome.exit_code
        raise SystemExit(outcome.exit_code)

    def _exit_now(self) -> None:
        """At interpreter exit after the controller's exit command (the
        script's own ``finally`` blocks and later ``atexit`` handlers have
        run): end the process without destroying the process groups, whose
        destructors can abort the process when a peer is gone (gloo throws
        from a destructor) or block on it."""
        if self._exit_code is not None:
            logs.exit_now(self._exit_code)

    def regroup(self, ranks: Sequence[int], generation: int, cancelled, store: Any = None) -> None:
        """Go on with ``ranks`` (elastic training: fewer, or all again): a
        new group over them, on ``store`` when given, with DDP moved onto it."""
        old = self.process_group
        new = AbortableProcessGroup(
            store if store is not None else old._store, self.rank, self.world_size, backend_factory=self.device.backend, timeout=old.timeout,
            namespace=job_namespace(), abort=self.device.abort, generation=generation, members=ranks, build=False)
        new.rebuild(generation, cancelled=cancelled)
        old.stop("replaced by a group of other ranks")
        old.replace_backend(None)
        self.process_group = new
        if self.ddp is not None:
            self._hook_group.group = new
            self.attach_ddp()
        log.warning("rank %d goes on with ranks %s", self.rank, list(ranks)[:16])

    def replicas_changed(self, step: int, replicas: int) -> None:
        """Training continues at ``step`` with ``replicas`` data-parallel replicas."""
        if replicas != self.replicas[-1]["replicas"]:
            self.replicas.append({"step": step, "replicas": replicas})
        if self.elastic_lr == "linear":
            self.optimizer.lr_factor = replicas / self.world_size

    def rolled_back(self, step: int) -> None:
        """Called by the rollback handler: training continues at ``step``."""
        self._step = step
        self._updated = False
        self.processor.step = step
        if self.processor.data is not DataStatus.UPDATED:
            self.processor.end_update(step)
        self.state.commit(step)

    # ------------------------------------------------------------- report
    def report(self) -> dict:
        """What happened so far: steps, lost steps, PIDs per rank, recoveries,
        and a hash of model + optimizer state (equal on every replica)."""
        return {
            "steps_completed": self._step,
            **self.history_report(),
            "final_state_sha256": state_sha256(self.state.model_and_optimizer()),
            "replicas": list(self.replicas),
            **self.snapshot_report(),
            **({"profiling": self.recorder.report()} if self.recorder else {}),
            "compile_cache": self.compile_cache.report(),
        }

    def close(self, *, finished: bool = True) -> None:
        """Say goodbye to the controller and remove trainguard's hooks."""
        if self.rehearsal is not None:
            if finished:
                self.rehearsal.final({**self.report(), "data_given": "data" in self.state.host,
                                      **fingerprints(self.state.module, self.state.own_part(), self.rank)})
            self.rehearsal.close()
            self.rehearsal = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._markers is not None:
            self._markers.close()
            self._markers = None
        self.processor.watchdog.disarm()  # waiting for the last persists is not a hung step
        self.close_snapshots(wait_s=self.save_timeout_s if finished else 0.0)
        if self.own_records is not None:
            self.own_records.close()
        self.processor.close(finished=finished)
        self.compile_cache.close()


_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))


def _refuse_unsupported(model: torch.nn.Module) -> None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    if isinstance(model, FullyShardedDataParallel) or any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigError("FSDP models are not supported by trainguard's torch adapter yet")
