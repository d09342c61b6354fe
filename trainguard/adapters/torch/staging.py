"""The staging buffer of GPU snapshots (``TRAINGUARD_SNAPSHOT_STAGING_MB``).

A device-to-host copy costs several microseconds however small, so with a
staging buffer the small tensors of a state do not leave one by one: each
run of tensors that sit back to back in the slot is first gathered on the
device into a buffer of the same byte layout (one ``_foreach_copy_`` per
dtype), then leaves in one copy. The buffer is split in two halves that
runs take in turn: a run is gathered on a stream of its own while the run
before it is still leaving the device, so the gathers (device-to-device, at
device-memory speed) hide behind the device-to-host copies. See
``bench/results/checkpoint-gpu.json`` and docs/development.md (performance notes).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["Run", "Staging"]


@dataclass
class Run:
    """Tensors back to back in the slot, gathered in one half of the staging buffer."""
    device: torch.device
    start: int  # byte offset in the slot's data
    end: int
    groups: dict = field(default_factory=lambda: defaultdict(lambda: ([], [])))  # dtype -> (indices, staging views)
    staged: torch.Tensor | None = None  # the staging buffer's bytes of this run


class Staging:
    """How one layout's device tensors travel to the host: runs of small
    tensors through a staging buffer of ``size`` bytes (gathered on the
    device into one half, one device-to-host copy each), larger tensors
    straight into the slot, host tensors by a host copy.

    With ``overlap`` (the default) the gathers run on a stream of their own,
    each waiting only for its half to be free, so run ``k + 1`` is gathered
    while run ``k`` is copied out; without, every step is on the caller's
    stream, one after the other."""

    def __init__(self, layout, paths: list[str], tensors: list[torch.Tensor], size: int, stage, *,
                 overlap: bool = True) -> None:
        self.key = (id(layout), size, tuple(t.device for t in tensors), overlap)
        self.overlap = overlap = overlap and any(t.is_cuda and stage(t) for t in tensors)  # streams: CUDA's
        self.runs: list[Run] = []
        self.direct: list[int] = []
        self.host: list[int] = []
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self._gather: dict[torch.device, torch.cuda.Stream] = {}
        limit = size // 2 if overlap else size  # a run fits one half
        order = sorted(range(len(paths)), key=lambda i: layout.offsets[paths[i]][0])
        run = None
        for i in order:
            t, (b, e) = tensors[i], layout.offsets[paths[i]]
            if e == b or not stage(t):  # empty (its view is a tensor of its own), or on the host
                self.host.append(i)
                if run is not None and run.end == b and e - run.start <= limit:
                    run.end = e  # rides along (an optimizer's step counters sit between its moments):
                    # the run lands garbage there, which the host copy after the synchronize replaces
            elif e - b > limit:
                self.direct.append(i)
                run = None
            else:
                if run is None or run.end != b or e - run.start > limit or run.device != t.device:
                    run = Run(t.device, b, b)
                    self.runs.append(run)
                run.end = e
                run.groups[t.dtype][0].append(i)
        self.overlap = overlap = overlap and len({run.device for run in self.runs}) == 1
        turns: dict[torch.device, int] = defaultdict(int)
        for run in self.runs:
            buf = self.buffers.get(run.device)
            if buf is None:
                buf = self.buffers[run.device] = torch.empty(size, dtype=torch.uint8, device=run.device)
            half = limit * (turns[run.device] % 2) if overlap else 0
            turns[run.device] += 1
            for dtype, (indices, views) in run.groups.items():
                for i in indices:
                    b, e = layout.offsets[paths[i]]
                    views.append(buf[half + b - run.start:half + e - run.start].view(dtype).view(tensors[i].shape))
            run.staged = buf[half:half + run.end - run.start]

    def copy_device(self, base: torch.Tensor, data_start: int, views: list[torch.Tensor],
                    tensors: list[torch.Tensor]) -> None:
        """Start the device tensors' copies into the slot (``base``, its views
        ``views``) behind the work queued on the current stream; the copies
        out end on the current stream (synchronize it, or an event recorded
        on it, before :meth:`copy_host` and before reading)."""
        gather, freed = None, {}
        if self.overlap and len(self.runs) > 1:
            device = self.runs[0].device
            out = torch.cuda.current_stream(device)
            gather = self._gather.get(device)
            if gather is None:
                gather = self._gather[device] = torch.cuda.Stream(device)
            gather.wait_stream(out)  # the tensors as the work queued so far leaves them
        for k, run in enumerate(self.runs):
            if gather is None:
                for indices, staged in run.groups.values():
                    torch._foreach_copy_(staged, [tensors[i] for i in indices])
            else:
                with torch.cuda.stream(gather):
                    if k - 2 in freed:  # its half is free once run k - 2 has left it
                        gather.wait_event(freed.pop(k - 2))
                    for indices, staged in run.groups.values():
                        torch._foreach_copy_(staged, [tensors[i] for i in indices])
                out.wait_event(gather.record_event())
            base[data_start + run.start:data_start + run.end].copy_(run.staged, non_blocking=True)
            if gather is not None:
                freed[k] = out.record_event()
        if self.direct:
            torch._foreach_copy_([views[i] for i in self.direct], [tensors[i] for i in self.direct],
                                 non_blocking=True)

    def copy_host(self, views: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """The host tensors' copies (after the device copies have landed)."""
        if self.host:
            torch._foreach_copy_([views[i] for i in self.host], [tensors[i] for i in self.host])
