"""Run a megatron-core script with all its ranks on one GPU over gloo (test
and benchmark scaffolding for a machine with a single GPU).

NCCL refuses two ranks on one device; gloo runs collectives on CUDA tensors
through host memory. torch's gloo backend crashes (SIGSEGV, seen with torch
2.11) on a *coalesced* all-gather of CUDA tensors, which megatron's DDP issues
to gather parameters after a distributed-optimizer step. This replaces the
``_coalescing_manager`` that megatron's grad/param buffers use with one that
lets the same collectives run one at a time: with synchronous collectives
(``overlap_grad_reduce`` / ``overlap_param_gather`` off) megatron ignores what
the manager yields, so the results are the same.

    python one_gpu_megatron.py SCRIPT [ARGS...]
"""

import contextlib
import runpy
import sys

from megatron.core.distributed import param_and_grad_buffer


@contextlib.contextmanager
def one_by_one(group=None, device=None, async_ops=False):
    if async_ops:
        raise RuntimeError("one_gpu_megatron.py runs synchronous collectives only: turn overlap_grad_reduce and "
                           "overlap_param_gather off")
    yield None


param_and_grad_buffer._coalescing_manager = one_by_one
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
