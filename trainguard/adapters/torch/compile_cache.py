"""torch.compile's caches across restarts (see :mod:`trainguard.core.compile_cache`).

Inductor keeps everything a compile produces in ``TORCHINDUCTOR_CACHE_DIR``:
the FX graph cache, the AOTAutograd cache and the compiled kernels (C++
libraries on a CPU, Triton binaries on a GPU). Each process gets a private
directory there, filled from the job's validated entry before the first
compile; with a hit, Dynamo still traces, but AOTAutograd and Inductor load
their results and no kernel is built. After the first step, a process that
found no usable entry publishes its directory as the entry.

Torch's portable "mega-cache" (``torch.compiler.save_cache_artifacts``)
holds the FX graph and AOTAutograd entries but, in torch 2.13, not the CPU
kernels' libraries: loading it still rebuilt every C++ kernel (7.6 s of a
warm first step of 8.8 s for a small MLP; 1.5 s with the whole directory),
so the directory is what is kept.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from trainguard.core.compile_cache import LocalCache, code_hash, cpu_model, script_hash

__all__ = ["TorchCompileCache", "key_parts"]

log = logging.getLogger("trainguard.torch")

#: torch's own counters shown beside trainguard's (torch._dynamo.utils.counters).
_TORCH_COUNTERS = (("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"),
                   ("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"))


def key_parts(model: torch.nn.Module, device: torch.device, extra: Mapping[str, Any] | None = None, *,
              torch_version: str | None = None) -> dict:
    """What compiled artifacts of ``model`` depend on: torch and Python
    versions, the device, the code of every module class in the model and
    of the script, parameter and buffer shapes, and ``extra`` (the user's
    configuration: input shapes, compile options).

    Raises:
        ConfigError: ``extra`` is not JSON (see :func:`~trainguard.core.compile_cache.cache_key`).
    """
    shapes = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        shapes.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return {
        "framework": "torch",
        "torch": torch_version or torch.__version__,
        "python": platform.python_version(),
        "device": _device_name(device),
        "model_code": code_hash(type(m) for m in model.modules()),
        "model_shapes": shapes.hexdigest(),
        "script": script_hash(),
        "config": dict(extra or {}),
    }


class TorchCompileCache:
    """Inductor's cache directory for this process, restored from and
    published to the job's entry: a
    :class:`~trainguard.core.compile_cache.LocalCache` (its arguments;
    ``parts`` from :func:`key_parts`) that Inductor is pointed at."""

    def __init__(self, root: Path | None, parts: Mapping[str, Any], *, warn: bool = True, owner: str = "") -> None:
        self.note = "off" if root is None else ""
        mine = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if root is not None and mine and os.path.abspath(mine) != os.path.abspath(_default_dir()):
            self.note = f"TORCHINDUCTOR_CACHE_DIR={mine} is set by the job: trainguard leaves Inductor's cache to it"
            log.info("%s: %s", owner, self.note)
            root = None
        if root is not None:
            if _inductor_caches_off():
                self.note = "Inductor's FX graph cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0): nothing to keep"
                log.warning("%s: %s", owner, self.note)
                root = None
        self.cache = LocalCache(root, parts if root is not None else {}, prefix="trainguard-inductor-",
                                warn=warn, owner=owner, skip=("locks",))
        if self.cache.local is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache.local)  # read by Inductor at each use
        self._counters_at_start = _torch_counters()

    def after_step(self) -> None:
        """Called after each completed step (publishes once, after the first)."""
        self.cache.after_step()

    def report(self) -> dict:
        """trainguard's counters, and torch's own cache hits and misses in this process."""
        if self.cache.cache is None:
            return {"state": "off", "reason": self.note}
        start = self._counters_at_start
        return {**self.cache.report(), "torch": {k: v - start.get(k, 0) for k, v in _torch_counters().items()}}

    def close(self) -> None:
        """Remove the private directory (kernels already loaded stay mapped)."""
        if self.cache.local is not None and os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(self.cache.local):
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        self.cache.close()


def _inductor_caches_off() -> bool:
    """Whether Inductor's FX graph cache is off in this process, read
    without importing Inductor when nothing has (importing it costs ~1.8 s
    of CPU in every Guard process, compiled or not): before the import its
    settings are the environment's."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        return not config.fx_graph_cache or config.force_disable_caches
    env = os.environ.get
    return env("TORCHINDUCTOR_FX_GRAPH_CACHE", env("TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT", "1")) == "0" or \
        env("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "0") == "1"


def _torch_counters() -> dict:
    """torch's cache counters; all 0 while Dynamo is not loaded (nothing compiled yet)."""
    if "torch._dynamo.utils" not in sys.modules:
        return {name: 0 for _, name in _TORCH_COUNTERS}
    from torch._dynamo.utils import counters

    return {name: counters[group][name] for group, name in _TORCH_COUNTERS}


def _default_dir() -> str:
    from torch._inductor.runtime.runtime_utils import default_cache_dir

    return default_cache_dir()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}:cuda{torch.version.cuda}"
    if device.type == "cpu":
        return f"cpu:{cpu_model()}:{torch.backends.cpu.get_cpu_capability()}"
    return device.type
