"""The state a MindSpore replica holds, gathered from the network and the
optimizer, and the per-step snapshot a retry rolls back to.

MindSpore keeps everything in named ``Parameter`` objects: trainable weights,
buffers such as BatchNorm's moving statistics (``requires_grad=False``), and
the optimizer's slots (``moments.*``, ``global_step``, a dynamic
``learning_rate``). :class:`ModelState` lists them once, by identity, in a
fixed order, so every replica enumerates the same tensors in the same order
for a broadcast and a checkpoint.
"""

from __future__ import annotations

import hashlib
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

__all__ = ["ModelState"]


class ModelState:
    """Every parameter of ``network`` and ``optimizer``, by name."""

    def __init__(self, network: nn.Cell, optimizer: nn.Cell) -> None:
        self.params: dict[str, Parameter] = {}
        seen: set[int] = set()
        for cell in (network, optimizer):
            for _, p in cell.parameters_and_names():
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.setdefault(p.name, p)
        if len(self.params) != len(seen):
            raise ValueError("two parameters share a name; MindSpore checkpoints need unique names")
        trainable = {id(p) for p in network.trainable_params()}
        # Changed by a forward pass (BatchNorm statistics): restored when a step is abandoned.
        self.buffers = [p for p in network.get_parameters() if id(p) not in trainable]
        self._buffer_snapshot: list[np.ndarray] = []
        self.snapshot_step: int | None = None

    def commit(self, step: int) -> None:
        """Remember the buffers of a consistent ``step`` (they are small)."""
        self._buffer_snapshot = [p.asnumpy().copy() for p in self.buffers]
        self.snapshot_step = step

    def restore_buffers(self) -> None:
        for p, value in zip(self.buffers, self._buffer_snapshot):
            ops.assign(p, Tensor(value))  # Tensor copies; assign: in place, kernels keep using the same storage

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: p.asnumpy() for name, p in self.params.items()}

    def load_arrays(self, arrays: dict[str, np.ndarray], *, source: str) -> None:
        """Set every parameter from ``arrays`` (same names, shapes and dtypes)."""
        missing = [n for n in self.params if n not in arrays]
        if missing:
            raise ValueError(f"{source} lacks {len(missing)} parameters, e.g. {missing[:3]}")
        for name, p in self.params.items():
            value = np.asarray(arrays[name])
            if value.shape != tuple(p.shape) or value.dtype != p.asnumpy().dtype:
                raise ValueError(f"{source}: {name} is {value.dtype}{list(value.shape)}, "
                                 f"the network has {p.asnumpy().dtype}{list(p.shape)}")
            ops.assign(p, Tensor(value))  # Tensor copies; assign: in place, kernels keep using the same storage

    def sha256(self) -> str:
        """A hash of every parameter's name, dtype, shape and bytes."""
        h = hashlib.sha256()
        for name in sorted(self.params):
            a = np.ascontiguousarray(self.params[name].asnumpy())
            h.update(f"{name}:{a.dtype}:{a.shape};".encode())
            h.update(a.tobytes())
        return h.hexdigest()
