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
import inspect
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from trainguard.core.compile_cache import CompileCache, Lookup

__all__ = ["TorchCompileCache", "key_parts"]

log = logging.getLogger("trainguard.torch")

_PREFIX = "trainguard-inductor-"

#: torch's own counters worth showing beside trainguard's (torch._dynamo.utils.counters).
_TORCH_COUNTERS = {("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                   ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss")}


def key_parts(model: torch.nn.Module, device: torch.device, extra: Mapping[str, Any] | None = None, *,
              torch_version: str | None = None) -> dict:
    """What compiled artifacts of ``model`` depend on: torch and Python
    versions, the device, the code of every module class in the model and
    of the script, parameter and buffer shapes, and ``extra`` (the user's
    configuration: input shapes, compile options)."""
    shapes = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        shapes.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return {
        "framework": "torch",
        "torch": torch_version or torch.__version__,
        "python": platform.python_version(),
        "device": _device_name(device),
        "model_code": _code_hash({type(m) for m in model.modules()}),
        "model_shapes": shapes.hexdigest(),
        "script": _script_hash(),
        "config": json.loads(json.dumps(dict(extra or {}), sort_keys=True, default=str)),
    }


class TorchCompileCache:
    """Inductor's cache directory for this process, restored from and
    published to the job's entry.

    Args:
        root: the job's cache directory, or ``None`` for none.
        parts: see :func:`key_parts`.
        warn: an unusable entry is a warning here (else INFO).
        owner: ``rank N`` for logs and the manifest.
    """

    def __init__(self, root: Path | None, parts: Mapping[str, Any], *, warn: bool = True, owner: str = "") -> None:
        self.cache: CompileCache | None = None
        self.local: Path | None = None
        self.note = ""
        self._published = False
        if root is None:
            self.note = "off"
            return
        mine = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if mine and os.path.abspath(mine) != os.path.abspath(_default_dir()):
            self.note = f"TORCHINDUCTOR_CACHE_DIR={mine} is set by the job: trainguard leaves Inductor's cache to it"
            log.info("%s: %s", owner, self.note)
            return
        import torch._inductor.config as inductor

        if not inductor.fx_graph_cache or inductor.force_disable_caches:
            self.note = "Inductor's FX graph cache is off (TORCHINDUCTOR_FX_GRAPH_CACHE=0): nothing to keep"
            log.warning("%s: %s", owner, self.note)
            return
        self.cache = CompileCache(root, parts, warn=warn, owner=owner)
        _remove_orphans()
        self.local = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        self._local_name = str(self.local)
        self.cache.restore(self.local)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.local)
        self._counters_at_start = _torch_counters()

    def after_step(self) -> None:
        """Called after each completed step; publishes once, after the
        first, when there was no usable entry."""
        if self._published or self.cache is None:
            return
        self._published = True
        if self.cache.state is not Lookup.HIT:
            self.cache.publish(self.local, skip=("locks",))

    def report(self) -> dict:
        """trainguard's counters, and torch's own cache hits and misses in this process."""
        if self.cache is None:
            return {"state": Lookup.OFF.value, "reason": self.note}
        start = self._counters_at_start
        return {**self.cache.report(), "local_dir": self._local_name,
                "torch": {k: v - start.get(k, 0) for k, v in _torch_counters().items()}}

    def close(self) -> None:
        """Remove the private directory (loaded kernels stay mapped)."""
        if self.local is not None:
            if os.environ.get("TORCHINDUCTOR_CACHE_DIR") == str(self.local):
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            shutil.rmtree(self.local, ignore_errors=True)
            self.local = None


def _remove_orphans() -> None:
    """Private directories of this machine's processes that died (a killed
    rank cannot clean up after itself)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        pid = path.name[len(_PREFIX):].split("-", 1)[0]
        try:
            if pid.isdigit() and path.stat().st_uid == os.getuid():
                os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _torch_counters() -> dict:
    from torch._dynamo.utils import counters

    return {name: counters[group][name] for group, name in sorted(_TORCH_COUNTERS)}


def _default_dir() -> str:
    from torch._inductor.runtime.runtime_utils import default_cache_dir

    return default_cache_dir()


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}:cuda{torch.version.cuda}"
    if device.type == "cpu":
        return f"cpu:{platform.machine()}:{_cpu_model()}:{torch.backends.cpu.get_cpu_capability()}"
    return device.type


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _code_hash(classes) -> str:
    digest = hashlib.sha256()
    for cls in sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            source = ""  # built-in or generated: its name (and torch's version) identify it
        digest.update(f"{cls.__module__}.{cls.__qualname__}\n{source}\n".encode())
    return digest.hexdigest()


def _script_hash() -> str:
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    try:
        return hashlib.sha256(script.read_bytes()).hexdigest() if script and script.is_file() else ""
    except OSError:
        return ""
