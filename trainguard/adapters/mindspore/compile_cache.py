"""MindSpore's graph compile cache across restarts (see :mod:`trainguard.core.compile_cache`).

MindSpore keeps compiled graphs when ``MS_COMPILER_CACHE_ENABLE=1``, under
``MS_COMPILER_CACHE_PATH/rank_<id>/graph_cache/`` (MindIR files and a hash
of the network's Python files), and reads both variables when it compiles
a graph, so trainguard sets them in the process itself: a job needs no
change to its launch script. The path is a private directory filled from
the job's validated entry for this rank; after the first step a process
that found no usable entry publishes it. Entries are per rank (MindSpore's
graphs and cache directories are). Graph mode only: in PyNative mode
nothing is compiled ahead and MindSpore's cache is left off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path
from typing import Any, Mapping

import mindspore as ms
from mindspore import nn

from trainguard.core.compile_cache import LocalCache, code_hash, cpu_model, script_hash

__all__ = ["MindSporeCompileCache", "key_parts"]

log = logging.getLogger("trainguard.mindspore")

_ENV = ("MS_COMPILER_CACHE_ENABLE", "MS_COMPILER_CACHE_PATH")


def key_parts(network: nn.Cell, parameters, *, rank: int, world_size: int,
              extra: Mapping[str, Any] | None = None, version: str | None = None) -> dict:
    """What this rank's compiled graphs depend on: MindSpore and Python
    versions, device target and CPU, execution mode, rank and world size,
    the code of every Cell class in the network and of the script,
    parameter shapes (network and optimizer) and ``extra``."""
    shapes = hashlib.sha256()
    for p in parameters:
        shapes.update(f"{p.name}:{tuple(p.shape)}:{p.dtype};".encode())
    return {
        "framework": "mindspore",
        "mindspore": version or ms.__version__,
        "python": platform.python_version(),
        "device": f"{ms.get_context('device_target')}:{cpu_model()}",
        "mode": "pynative" if ms.get_context("mode") == ms.PYNATIVE_MODE else "graph",
        "rank": rank,
        "world_size": world_size,
        "model_code": code_hash(type(cell) for _, cell in network.cells_and_names()),
        "model_shapes": shapes.hexdigest(),
        "script": script_hash(),
        "config": dict(extra or {}),
    }


class MindSporeCompileCache:
    """``MS_COMPILER_CACHE_PATH`` for this process, restored from and
    published to the job's entry for this rank: a
    :class:`~trainguard.core.compile_cache.LocalCache` (its arguments;
    ``parts`` from :func:`key_parts`) that MindSpore is pointed at."""

    def __init__(self, root: Path | None, parts: Mapping[str, Any], *, warn: bool = True, owner: str = "") -> None:
        self.note = "off" if root is None else ""
        if root is not None and ms.get_context("mode") == ms.PYNATIVE_MODE:
            self.note = "PyNative mode: no graphs to keep (the compile cache serves graph mode)"
            root = None
        theirs = {k: os.environ[k] for k in _ENV if os.environ.get(k)}
        if root is not None and theirs:
            self.note = (f"{', '.join(f'{k}={v}' for k, v in theirs.items())} set by the job: trainguard leaves "
                         f"MindSpore's compile cache to it")
            log.info("%s: %s", owner, self.note)
            root = None
        self.cache = LocalCache(root, parts if root is not None else {}, prefix="trainguard-mscache-", warn=warn,
                                owner=owner)
        self._graphs: int | None = None
        if self.cache.local is not None:
            os.environ.update(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=str(self.cache.local))

    def after_step(self) -> None:
        """Called after each completed step (publishes once, after the first)."""
        if self._graphs is None and self.cache.local is not None:
            self._graphs = sum(1 for _ in self.cache.local.rglob("*.mindir"))
        self.cache.after_step()

    def report(self) -> dict:
        if self.cache.cache is None:
            return {"state": "off", "reason": self.note}
        return {**self.cache.report(), "mindspore": {"graph_files_after_first_step": self._graphs}}

    def close(self) -> None:
        """Stop pointing MindSpore at the private directory and remove it."""
        if self.cache.local is not None and os.environ.get("MS_COMPILER_CACHE_PATH") == str(self.cache.local):
            for k in _ENV:
                os.environ.pop(k, None)
        self.cache.close()
