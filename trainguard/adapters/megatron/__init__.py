"""The Megatron-core adapter: replica layout from ``parallel_state``,
Megatron's checkpoint layout, and the replicated distributed optimizer
(:mod:`.optimizer`, imported on demand: it needs megatron-core's optimizer
package). The MindIO-style entry points are in
:mod:`trainguard.compat.mindio_ttp`."""

from .checkpoint import load, megatron_store, save, write_rank
from .layout import ParallelRank, parallel_rank, replica_groups

__all__ = ["ParallelRank", "load", "megatron_store", "parallel_rank", "replica_groups", "save", "write_rank"]
