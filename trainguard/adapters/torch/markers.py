"""Profiling markers for the torch Guard: FP and Communication on top of the
loop's Step, DataLoader and SaveCheckpoint spans
(:class:`~trainguard.core.profiling.markers.LoopMarkers`).

Nothing is installed while the switch is off. The switch is applied at step
boundaries on the training thread (hooks and kernels are never added or
removed under a running step):

* **FP**: a forward pre-hook and hook on the model.
* **Communication**, two sources, each collective recorded once:
  trainguard's own process group (DDP's gradient all-reduces go through its
  comm hook) tells an observer; every other c10d collective -- plain
  ``dist.all_reduce`` on any group, Megatron's tensor- and pipeline-parallel
  groups -- passes a kernel registered with ``torch.library`` for the c10d
  operators at the Autograd key, which times it and redispatches. Both time
  a collective from issue to completion (its future's callback), so a rank
  whose peers are late sees it outstanding longer. Point-to-point work on
  gloo has no future: it is timed to the end of the call.
  Limits: collectives issued under ``torch.inference_mode`` bypass the
  Autograd key and are not seen.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

from trainguard.core.profiling import Recorder
from trainguard.core.profiling.markers import LoopMarkers

__all__ = ["TorchMarkers"]

#: c10d operators timed by the dispatcher kernel.
C10D_OPS = ("allreduce_", "allreduce_coalesced_", "broadcast_", "allgather_", "_allgather_base_",
            "allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_",
            "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_", "gather_", "scatter_",
            "alltoall_", "alltoall_base_", "barrier", "send", "recv_")

_inside = threading.local()  # set while the dispatcher kernel runs a collective


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _groups(found: Any) -> list[Any]:
    return list(found) if isinstance(found, (list, tuple)) else [] if found is None else [found]


def _name(group: Any) -> str:
    """trainguard's group, by generation (the same name on every rank)."""
    return f"trainguard-g{group.generation}"


class TorchMarkers(LoopMarkers):
    """Markers for one Guard.

    Args:
        recorder: where spans go.
        modules: the model (unwrapped; Megatron's model chunks) whose forward is FP.
        step: returns the number of completed steps (the loop index).
        group: returns trainguard's current process group, or a list of
            them (the ``trainguard`` backend's groups), or ``None``.
    """

    def __init__(self, recorder: Recorder, modules: Sequence[torch.nn.Module], step: Callable[[], int],
                 group: Callable[[], Any] = lambda: None) -> None:
        super().__init__(recorder, step)
        self._modules, self._group = list(modules), group
        self._fp_hooks: list[Any] = []
        self._library: torch.library.Library | None = None
        self._observed: list[Any] = []
        self._group_names: set[str] = set()

    def iteration_start(self) -> None:
        super().iteration_start()
        if self._library is not None and [id(g) for g in self._observed] != [id(g) for g in _groups(self._group())]:
            self._observe(self._group())  # elastic training replaced the group; a script made new ones

    def install(self, markers: bool, communication: bool) -> None:
        if not markers or self._fp_hooks:
            for hook in self._fp_hooks:
                hook.remove()
            self._fp_hooks = []
        if markers:
            for module in self._modules:
                self._fp_hooks += [module.register_forward_pre_hook(self.fp_begin),
                                   module.register_forward_hook(self.fp_end)]
        if communication and self._library is None:
            self._library = self._register_kernels()
            self._observe(self._group())
        elif not communication and self._library is not None:
            self._library._destroy()
            self._library = None
            self._observe(None)
        super().install(markers, communication)

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The modules whose forward is FP."""
        return list(self._modules)

    def set_modules(self, modules: Sequence[torch.nn.Module]) -> None:
        """Time the forward of ``modules`` from now on (hooks move at once)."""
        self._modules = list(modules)
        self.install(*self.installed)

    # -------------------------------------------------- communication
    def _observe(self, found: Any) -> None:
        for group in self._observed:
            group.observer = None
        self._observed = _groups(found)
        for group in self._observed:
            try:  # a group torch.distributed made or took as its default (the abortable one): name, global ranks
                name = dist.distributed_c10d._world.pg_names.get(group) or group.group_name
                ranks = dist.get_process_group_ranks(group)
            except (ValueError, RuntimeError, AttributeError):  # the Guard's own group
                name, ranks = _name(group), list(group.members)
            group.observer = functools.partial(self._on_issue, name)
            self.recorder.group(name, ranks, "trainguard")

    def _on_issue(self, name: str, op: str, args: tuple, work: Any) -> None:
        """trainguard's group ``name`` issued ``op`` (called on the issuing thread)."""
        if getattr(_inside, "active", False) or not self.recorder.communication:
            return  # the dispatcher kernel records it
        self._time(op, name, _nbytes(args[0]), time.time(), work)

    def _time(self, op: str, group: str, nbytes: int, start: float, work: Any) -> None:
        rec, step = self.recorder, self.current
        extra = {"op": op, "group": group, "bytes": nbytes}

        def done(_fut: Any) -> None:
            rec.add("Communication", step, start, time.time() - start, extra)

        try:
            work.get_future().then(done)
        except RuntimeError:  # gloo's point-to-point work has no future
            done(None)

    def _register_kernels(self) -> torch.library.Library:
        library = torch.library.Library("c10d", "IMPL")
        for name in C10D_OPS:
            packet = getattr(torch.ops.c10d, name, None)
            if packet is None:
                continue
            op = packet.default
            index = next(i for i, a in enumerate(op._schema.arguments) if a.name == "process_group")
            library.impl(name, self._kernel(op, name.strip("_"), index), "Autograd")
        return library

    def _kernel(self, op: Any, label: str, group_index: int) -> Callable:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            _inside.active = True
            try:
                with torch._C._AutoDispatchBelowAutograd():
                    out = op(*args, **kwargs)
            finally:
                _inside.active = False
            if self.recorder.communication:
                work = out[1] if isinstance(out, tuple) else out
                self._time(label, self._group_name(args[group_index]), _nbytes(args[0]), start,
                           c10d.Work.unbox(work))
            return out
        return kernel

    def _group_name(self, boxed: Any) -> str:
        group = dist.ProcessGroup.unbox(boxed)
        name = group.group_name
        if name not in self._group_names:
            try:
                ranks = dist.get_process_group_ranks(group)
            except (ValueError, RuntimeError):  # a group c10d does not track
                ranks = []
            self.recorder.group(name, ranks, group.name())
            self._group_names.add(name)
        return name
