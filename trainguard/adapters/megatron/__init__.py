"""The Megatron-core adapter: replica layout from ``parallel_state``,
Megatron's checkpoint layout, and the replicated distributed optimizer
(:mod:`.optimizer`, imported on demand: it needs megatron-core's optimizer
package); and the rank runtime of a Megatron script driven by the TTP API
(:mod:`.session`, :mod:`.runtime`, :mod:`.handlers`, :mod:`.recovery`,
:mod:`.saves`, :mod:`.markers`, :mod:`.distributed`). The MindIO-style
entry points over it are in :mod:`trainguard.compat.mindio_ttp`.

The names below are imported when first asked for, so that the TTP
session and runtime load without torch."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ParallelRank", "load", "megatron_store", "parallel_rank", "replica_groups", "save", "write_rank"]

_WHERE = {"load": "checkpoint", "megatron_store": "checkpoint", "save": "checkpoint", "write_rank": "checkpoint",
          "ParallelRank": "layout", "parallel_rank": "layout", "replica_groups": "layout"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
