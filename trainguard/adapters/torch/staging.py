"""The staging buffer of GPU snapshots (``TRAINGUARD_SNAPSHOT_STAGING_MB``).

A device-to-host copy costs several microseconds however small, so with a
staging buffer the small tensors of a state do not leave one by one: each
run of tensors that sit back to back in the slot is first gathered on the
device into a buffer of the same byte layout (one ``_foreach_copy_`` per
dtype), then leaves in one copy. Off by default: see
``bench/results/checkpoint-gpu.json`` and the README's performance notes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["Run", "Staging"]


@dataclass
class Run:
    """Tensors back to back in the slot, gathered in the staging buffer."""
    device: torch.device
    start: int  # byte offset in the slot's data
    end: int
    groups: dict = field(default_factory=lambda: defaultdict(lambda: ([], [])))  # dtype -> (indices, staging views)
    staged: torch.Tensor | None = None  # the staging buffer's bytes of this run


class Staging:
    """How one layout's device tensors travel to the host: runs of small
    tensors through a staging buffer of ``size`` bytes (one gather on the
    device, one device-to-host copy each), larger tensors straight into the
    slot, host tensors by a host copy."""

    def __init__(self, layout, paths: list[str], tensors: list[torch.Tensor], size: int, stage) -> None:
        self.key = (id(layout), size, tuple(t.device for t in tensors))
        self.runs: list[Run] = []
        self.direct: list[int] = []
        self.host: list[int] = []
        self.buffers: dict[torch.device, torch.Tensor] = {}
        order = sorted(range(len(paths)), key=lambda i: layout.offsets[paths[i]][0])
        run = None
        for i in order:
            t, (b, e) = tensors[i], layout.offsets[paths[i]]
            if e == b or not stage(t):  # empty (its view is a tensor of its own), or on the host
                self.host.append(i)
                if run is not None and run.end == b and e - run.start <= size:
                    run.end = e  # rides along (an optimizer's step counters sit between its moments):
                    # the run lands garbage there, which the host copy after the synchronize replaces
            elif e - b > size:
                self.direct.append(i)
                run = None
            else:
                if run is None or run.end != b or e - run.start > size or run.device != t.device:
                    run = Run(t.device, b, b)
                    self.runs.append(run)
                run.end = e
                run.groups[t.dtype][0].append(i)
        for run in self.runs:
            buf = self.buffers.get(run.device)
            if buf is None:
                buf = self.buffers[run.device] = torch.empty(size, dtype=torch.uint8, device=run.device)
            for dtype, (indices, views) in run.groups.items():
                for i in indices:
                    b, e = layout.offsets[paths[i]]
                    views.append(buf[b - run.start:e - run.start].view(dtype).view(tensors[i].shape))
            run.staged = buf[:run.end - run.start]

    def copy_device(self, base: torch.Tensor, data_start: int, views: list[torch.Tensor],
                    tensors: list[torch.Tensor]) -> None:
        """Start the device tensors' copies into the slot (``base``, its views
        ``views``); synchronize before :meth:`copy_host` and before reading."""
        for run in self.runs:  # in stream order: a run's gather waits for the previous run to leave the buffer
            for indices, staged in run.groups.values():
                torch._foreach_copy_(staged, [tensors[i] for i in indices])
            base[data_start + run.start:data_start + run.end].copy_(run.staged, non_blocking=True)
        if self.direct:
            torch._foreach_copy_([views[i] for i in self.direct], [tensors[i] for i in self.direct],
                                 non_blocking=True)

    def copy_host(self, views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """The host tensors' copies (after the device copies have landed)."""
        if self.host:
            torch._foreach_copy_([views[i] for i in self.host], [tensors[i] for i in self.host])

