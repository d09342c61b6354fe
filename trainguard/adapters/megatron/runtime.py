"""The rank runtime of a Megatron script driven by the TTP API.

The TTP flow has no ``steps()`` loop: the script calls module-level
functions at fixed points of its own loop, and these carry them out on
:data:`~.session.TTP` -- serve the controller (:func:`serve_controller`),
connect the rank's processor (:func:`start_processor`), the update window
(:func:`start_update`, :func:`end_update`), the objects a handler gets
(:func:`set_args`), the way out of a failed step (:func:`persist`, the
wrapper around the training function, and :func:`handle`), and the
replicated optimizer that tells the processor its replica layout. The drop-in
names over them are :mod:`trainguard.compat.mindio_ttp.framework_ttp`.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from typing import Any, Callable, Sequence

from trainguard.core import (
    ConfigError,
    ControllerConfig,
    ControllerLostError,
    DataStatus,
    ForceStop,
    Processor,
    ProcessorConfig,
    recover,
    report_left_step,
)
from trainguard.core import logs
from trainguard.core.classify import Classifier
from trainguard.core.secret import shared_secret

from . import markers
from .distributed import all_pids, blocked_in_collective
from .handlers import TtpHandlers
from .session import TTP, checked_int

__all__ = ["end_update", "handle", "persist", "replicated_optimizer", "replicated_optimizer_class", "serve_controller",
           "set_args", "start_processor", "start_update"]

log = logging.getLogger("trainguard.compat.mindio")


def serve_controller(bind_ip: str, port: int) -> None:
    """Serve the job's controller at ``bind_ip:port`` in a thread, unless
    the launcher serves one (``TRAINGUARD_CONTROLLER``) or it runs already."""
    if TTP.controller_args is None:
        raise ConfigError("call ttp_init_controller (tft_init_controller) before starting the controller")
    if TTP.controller is not None:
        return  # the wrapped function runs again after an in-place recovery
    if TTP.settings.controller:
        log.info("the launcher's controller at %s serves this job; %s:%s is not bound",
                 TTP.settings.controller, bind_ip, port)
        return
    from trainguard.core import Controller  # grpc server: only on the rank that serves

    token = shared_secret(needed_by="a controller served from the training script (or launch with `trainguard "
                          "run`, which makes a secret)")
    config = ControllerConfig.from_env(host=bind_ip, port=checked_int("port", port, minimum=1))
    TTP.controller = Controller(config, TTP.controller_args["world_size"], token=token)
    address = TTP.controller.start()
    atexit.register(TTP.controller.stop)
    log.info("trainguard controller for %d ranks serves at %s", TTP.controller_args["world_size"], address)


def start_processor(master_ip: str, port: int) -> None:
    """Connect this rank's processor to the controller (the launcher's, else
    ``master_ip:port``) with its replica groups; start the markers."""
    if TTP.rank is None:
        raise ConfigError("call ttp_init_processor (tft_init_processor) before starting the processor")
    if TTP.processor is not None and TTP.processor.connected:
        return  # the wrapped function runs again after an in-place recovery
    logs.setup(f"rank {TTP.rank}")
    environ = dict(os.environ)
    environ.setdefault("TRAINGUARD_CONTROLLER", f"{master_ip}:{checked_int('port', port, minimum=1)}")
    config = ProcessorConfig.from_env(rank=TTP.rank, world_size=TTP.world_size, environ=environ)
    processor = Processor(config)
    processor.connect(step=TTP.step, replicas=TTP.groups(), device=TTP.device,
                      restart_count=TTP.settings.restart_count,
                      # known only when the script loads before it starts the processor (the recipe
                      # loads after: no restart-loop check on this path)
                      resumed_after_dump=TTP.resumed_after_dump(TTP.step))
    processor.add_stop_listener(lambda: TTP.call("stop", optional=True))
    processor.watchdog.in_collective = blocked_in_collective(threading.get_ident())
    TTP.processor = processor
    TTP.pids, started_at = all_pids()
    markers.start(started_at)
    atexit.register(TTP.exit_now)


def set_args(args: Any) -> None:
    """What the handlers get as ``args`` (set after every iteration); tells
    the markers and the args hooks (the snapshots)."""
    TTP.args = args
    markers.set_args(args)
    for hook in TTP.args_hooks:
        hook(args)


def start_update() -> None:
    """The optimizer update starts (a STOP already received ends the step
    here); tells the update hooks the step it will commit."""
    processor = TTP.live()
    if processor.stop_event.is_set():
        raise ForceStop("stopped before the optimizer update")
    processor.start_update()
    for hook in TTP.update_hooks:
        hook(TTP.step + 1)


def end_update(step: int) -> None:
    """The update ended; the state is that of ``step`` completed updates."""
    TTP.live().end_update(checked_int("step", step))
    TTP.step = step
    for hook in TTP.commit_hooks:
        hook(step)
    markers.step_end()


def persist(func: Callable) -> Callable:
    """Run ``func``; on an exception, let the controller decide: after an
    in-place repair ``func`` is called again, after a dump the process exits."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return func(*args, **kwargs)
            except Exception as error:
                if TTP.processor is None:
                    raise
                handle(error)  # returns only when training resumes in place

    return wrapper


def handle(error: Exception) -> None:
    """Report ``error`` and carry out the controller's recovery with the
    registered handlers; returns when training resumes in place, else runs
    the exit handler and leaves with the controller's exit code."""
    processor = TTP.processor
    phase = "optimizer" if processor.data is DataStatus.UPDATING else "step"
    report_left_step(processor, error, TTP.classifier or Classifier(), phase=phase)  # logs it too
    try:
        outcome = recover(processor, TtpHandlers(TTP))
    except ControllerLostError as lost:
        raise error from lost
    if outcome.resume:
        TTP.repair_step, TTP.repair_type = outcome.step, (outcome.record or {}).get("strategy", "")
        return
    TTP.call("exit", optional=True)
    log.info("rank %d exits with code %d: %s", processor.rank, outcome.exit_code, outcome.reason)
    markers.close()
    processor.close(finished=False)
    TTP.exit_code = outcome.exit_code
    raise SystemExit(outcome.exit_code)


def replicated_optimizer(config: Any, model_chunks: Sequence[Any], **kwargs: Any) -> Any:
    """megatron-core's ``get_megatron_optimizer(config, model_chunks)`` with
    the distributed optimizer kept in parallel_state's instances (two or
    more); tells this process's processor the replica layout."""
    from .optimizer import replicated_optimizer as build

    optimizer = build(config, model_chunks, **kwargs)
    TTP.replicas = optimizer.replica_groups
    return optimizer


_replicated: Any = None


def replicated_optimizer_class() -> type:
    """:class:`.optimizer.ReplicatedOptimizer` that also tells this
    process's processor its replica layout (imports megatron-core's
    optimizer package only when asked for)."""
    global _replicated
    if _replicated is None:
        from .optimizer import ReplicatedOptimizer as Base

        class ReplicatedOptimizer(Base):
            """Also tells this process's processor its replica layout."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                TTP.replicas = self.replica_groups

        _replicated = ReplicatedOptimizer
    return _replicated
