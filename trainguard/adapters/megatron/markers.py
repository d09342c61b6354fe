"""Profiling markers for a loop driven by the TTP API (Megatron through torch).

The TTP flow has no loop object of trainguard's, so the calls it already
makes carry the markers: the processor's start opens the first Step span,
``ttp_end_updating_os`` closes each step and opens the next (the batch
fetch of the next iteration falls inside it), and ``ttp_set_ckpt_args``
names the model -- Megatron's list of model chunks -- whose forward is FP.
Communication is every c10d collective (the torch adapter's dispatcher
kernel): Megatron's data-, tensor- and pipeline-parallel groups.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any

from trainguard.core.profiling import recorder_from_env

from .session import TTP

__all__ = ["start", "set_args", "step_end", "close"]


def start(started_at: float) -> None:
    """When profiling is configured and torch is in use, start the markers."""
    if TTP.markers is not None or "torch" not in sys.modules:
        return
    recorder = recorder_from_env(rank=TTP.rank, started_at=started_at)
    if recorder is None:
        return
    from trainguard.adapters.torch import backend  # groups of init_process_group("trainguard"), if any
    from trainguard.adapters.torch.markers import TorchMarkers

    TTP.markers = TorchMarkers(recorder, _modules(TTP.args), lambda: TTP.step, backend.groups)
    TTP.markers.iteration_start()
    atexit.register(close)  # the last records reach the disk


def set_args(args: Any) -> None:
    if TTP.markers is not None and not TTP.markers.modules:
        modules = _modules(args)
        if modules:
            TTP.markers.set_modules(modules)


def step_end() -> None:
    if TTP.markers is not None:
        TTP.markers.step_end()
        TTP.markers.iteration_start()


def close() -> None:
    if TTP.markers is not None:
        TTP.markers.close()
        TTP.markers = None


def _modules(args: Any) -> list:
    """The torch modules among the checkpoint args (Megatron's ``model`` is a list of chunks)."""
    torch = sys.modules.get("torch")
    if torch is None or args is None:
        return []
    items = list(args) if isinstance(args, (tuple, list)) else [args]
    found = []
    for item in items:
        for obj in (item if isinstance(item, (list, tuple)) else [item]):
            if isinstance(obj, torch.nn.Module):
                found.append(getattr(obj, "module", obj) if type(obj).__name__ == "DistributedDataParallel" else obj)
    return found
