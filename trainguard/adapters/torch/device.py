"""What each kind of device can do during a recovery.

* ``cpu``: gloo; a device memory error is simulated (the fault injector
  raises it), so cleaning always succeeds and in-process repair is possible.
* ``cuda``: NCCL; a real uncorrectable error poisons the CUDA context and
  cannot be cleaned in-process, so the device reports itself not repairable
  and the controller escalates a UCE to a process-level strategy (dump).
  Communication faults are still retried in-process: the NCCL communicator
  is aborted and rebuilt. A job that chose gloo for its default group
  (several ranks sharing one GPU, which NCCL refuses) gets gloo here too:
  gloo runs collectives on CUDA tensors through host memory.
* ``npu``: HCCL through ``torch_npu``; when ``torch_npu.npu`` offers
  ``stop_device`` / ``restart_device`` (the calls MindSpeed uses for UCE
  repair), the device is cleaned in-process.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard.core.rank.recovery import CLEAN_FAILED, CLEAN_OK

__all__ = ["Device", "for_module"]

log = logging.getLogger("trainguard.torch")


class Device:
    """The CPU device (and the base of the others)."""

    name = "cpu"

    @property
    def repairable(self) -> bool:
        """Whether a device memory error can be repaired without a restart."""
        return True

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.name)

    def backend(self, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    def clean(self, uce: bool) -> int:
        return CLEAN_OK

    def abort(self, backend: Any) -> None:
        """Release device work stuck in ``backend`` (gloo needs nothing)."""


class CudaDevice(Device):
    name = "cuda"

    def __init__(self, index: int) -> None:
        self.index = index

    @property
    def repairable(self) -> bool:
        return False

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def backend(self, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        if dist.is_initialized() and dist.get_backend() == "gloo":
            return super().backend(store, rank, size, timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    def abort(self, backend: Any) -> None:
        abort = getattr(backend, "abort", None)
        if abort is None:
            log.warning("this torch's NCCL backend has no abort(); stuck kernels stay queued")
            return
        try:
            abort()
        except Exception:
            log.exception("aborting the NCCL communicator failed")

    def clean(self, uce: bool) -> int:
        if uce:
            log.error("a device memory error on cuda:%d cannot be repaired in-process", self.index)
            return CLEAN_FAILED
        torch.cuda.synchronize(self.index)
        return CLEAN_OK


class NpuDevice(Device):
    name = "npu"

    def __init__(self, index: int) -> None:
        self.index = index
        self._npu = importlib.import_module("torch_npu").npu

    @property
    def repairable(self) -> bool:
        return hasattr(self._npu, "stop_device") and hasattr(self._npu, "restart_device")

    @property
    def torch_device(self) -> torch.device:
        return torch.device("npu", self.index)

    def backend(self, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
        hccl = importlib.import_module("torch_npu._C._distributed_c10d")
        opts = hccl.ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return hccl.ProcessGroupHCCL(store, rank, size, opts)

    def clean(self, uce: bool) -> int:
        if not uce:
            return CLEAN_OK
        if not self.repairable:
            return CLEAN_FAILED
        self._npu.stop_device(self.index)
        self._npu.restart_device(self.index, rebuild_all_resources=True)
        return CLEAN_OK


def for_module(module: torch.nn.Module) -> Device:
    """The device layer for where ``module``'s parameters live."""
    param = next(iter(module.parameters()), None)
    where = param.device if param is not None else torch.device("cpu")
    if where.type == "cuda":
        return CudaDevice(where.index or 0)
    if where.type == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise RuntimeError("parameters live on an npu but torch_npu is not importable")
        return NpuDevice(where.index or 0)
    if where.type != "cpu":
        raise RuntimeError(f"trainguard does not support {where.type} devices yet")
    return Device()
