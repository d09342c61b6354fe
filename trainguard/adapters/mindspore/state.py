"""The state a MindSpore replica holds, gathered from the network and the
optimizer, and the per-step snapshot a retry rolls back to: the buffers a
forward pass moves, and this rank's random streams (Python's, NumPy's
global one, MindSpore's default generator and the op seeds its functional
random operators draw from: ``ops.dropout``, ``ops.randn``...), so a retried
step draws what the abandoned one drew. Operators built once with their
seeds (``nn.Dropout``'s ``ops.Dropout``) keep their state inside the kernel,
which MindSpore cannot save or set (:func:`.random_ops.kernel_random_ops`
finds them).

MindSpore keeps everything in named ``Parameter`` objects: trainable weights,
buffers such as BatchNorm's moving statistics (``requires_grad=False``), and
the optimizer's slots (``moments.*``, ``global_step``, a dynamic
``learning_rate``). :class:`ModelState` lists them once, by identity, in a
fixed order, so every replica enumerates the same tensors in the same order
for a broadcast and a checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib
import random
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

__all__ = ["ModelState", "set_streams", "stream_fingerprints", "streams", "streams_sha256"]

#: MindSpore's op seeds: the functional random operators derive each call's
#: seeds from this table, (kernel name, op seed) -> the next seed, and
#: advance it (``mindspore/common/seed.py``).
_OP_SEEDS: dict = importlib.import_module("mindspore.common.seed")._KERNEL_SEED


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
        self._streams: dict[str, Any] | None = None
        self._update_streams: tuple[int, dict[str, Any]] | None = None  # (step, streams) when its update began
        self._update_buffers: tuple[int, list[np.ndarray]] | None = None  # (step, buffers) when its update began
        self.snapshot_step: int | None = None

    def commit(self, step: int) -> None:
        """Remember the buffers and the random streams of a consistent
        ``step`` (they are small)."""
        self._buffer_snapshot = [p.asnumpy().copy() for p in self.buffers]
        self._streams = streams()
        self.snapshot_step = step

    def restore_buffers(self) -> None:
        for p, value in zip(self.buffers, self._buffer_snapshot):
            ops.assign(p, Tensor(value))  # Tensor copies; assign: in place, kernels keep using the same storage

    def updating(self, step: int) -> None:
        """The update to ``step`` begins: the step drew its random numbers
        and its forward pass moved the buffers."""
        self._update_streams = (step, streams())
        self._update_buffers = (step, [p.asnumpy().copy() for p in self.buffers])

    def buffers_at(self, step: int) -> dict[str, np.ndarray] | None:
        """This rank's own buffers at ``step`` by name (its commit of
        ``step``, or when its update to ``step`` began); ``None`` when it
        knows neither. BatchNorm's moving statistics are each rank's own (a
        data-parallel all-reduce moves gradients only), so a replica's are
        not this rank's."""
        if self.snapshot_step == step:
            own = self._buffer_snapshot
        elif self._update_buffers is not None and self._update_buffers[0] == step:
            own = self._update_buffers[1]
        else:
            return None
        return {p.name: value for p, value in zip(self.buffers, own)}

    def restore_own_buffers(self, step: int) -> bool:
        """Set the buffers back to this rank's own of ``step``
        (:meth:`buffers_at`) after a repair from a replica. False when it
        knows none."""
        own = self.buffers_at(step)
        if own is None:
            return False
        self.set_buffers(own, source="this rank's own buffers")
        return True

    def set_buffers(self, arrays: dict[str, np.ndarray], *, source: str) -> None:
        """Set every buffer from ``arrays`` (the same names, shapes and dtypes).

        Raises:
            ValueError: ``arrays`` is not this network's buffers.
        """
        names = {p.name for p in self.buffers}
        if set(arrays) != names:
            raise ValueError(f"{source} holds buffers {sorted(set(arrays) ^ names)[:3]} the network does not, "
                             f"or lacks them")
        for p in self.buffers:
            value = arrays[p.name]
            if value.shape != tuple(p.shape) or value.dtype != p.asnumpy().dtype:
                raise ValueError(f"{source}: {p.name} is {value.dtype}{list(value.shape)}, "
                                 f"the network has {p.asnumpy().dtype}{list(p.shape)}")
        for p in self.buffers:
            ops.assign(p, Tensor(arrays[p.name]))

    def streams_at(self, step: int) -> dict[str, Any] | None:
        """This rank's random streams at ``step``: at its commit of
        ``step``, or when its update to ``step`` began (a rank whose update
        failed, then repaired to ``step`` from a replica); ``None`` when it
        knows neither."""
        if self.snapshot_step == step and self._streams is not None:
            return self._streams
        if self._update_streams is not None and self._update_streams[0] == step:
            return self._update_streams[1]
        return None

    def restore_streams(self, step: int) -> bool:
        """Set this rank's random streams to :meth:`streams_at` ``step``;
        False when it knows none (its streams stay as they are)."""
        now = self.streams_at(step)
        if now is None:
            return False
        set_streams(now)
        return True

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
        return _sha256(self.params.values())

    def buffers_sha256(self) -> str:
        """A hash of the buffers alone (each rank's own)."""
        return _sha256(self.buffers)


def _sha256(params) -> str:
    h = hashlib.sha256()
    for p in sorted(params, key=lambda p: p.name):
        a = np.ascontiguousarray(p.asnumpy())
        h.update(f"{p.name}:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def streams() -> dict[str, Any]:
    """This process's random streams, as copies."""
    return {"python": random.getstate(), "numpy": np.random.get_state(),
            "mindspore": Tensor(ms.get_rng_state().asnumpy().copy()), "ops": dict(_OP_SEEDS)}


def set_streams(now: dict[str, Any]) -> None:
    """Set this process's random streams to ``now`` (:func:`streams`'s;
    ``ops`` None: a record written before they were kept, which leaves
    the op seeds as they are)."""
    random.setstate(now["python"])
    np.random.set_state(now["numpy"])
    ms.set_rng_state(now["mindspore"])
    if now.get("ops") is not None:
        _OP_SEEDS.clear()
        _OP_SEEDS.update(now["ops"])


def stream_fingerprints() -> dict[str, str]:
    """For ``trainguard rehearse``: MindSpore's streams (its generator and
    op seeds) apart from Python's and NumPy's, which a script may leave
    unseeded."""
    now = streams()
    kind, keys, pos, gauss, cached = now["numpy"]
    return {"streams": hashlib.sha256(now["mindspore"].asnumpy().tobytes() +
                                      repr(sorted(now["ops"].items())).encode()).hexdigest(),
            "python": hashlib.sha256(repr(now["python"]).encode()).hexdigest(),
            "numpy": hashlib.sha256(f"{kind}:{pos}:{gauss}:{cached};".encode() + keys.tobytes()).hexdigest()}


def streams_sha256() -> str:
    """A hash of this process's random streams (for reports and tests)."""
    now = streams()
    h = hashlib.sha256(repr(now["python"]).encode())
    kind, keys, pos, gauss, cached = now["numpy"]
    h.update(f"{kind}:{pos}:{gauss}:{cached};".encode() + keys.tobytes())
    h.update(now["mindspore"].asnumpy().tobytes())
    h.update(repr(sorted(now["ops"].items())).encode())
    return h.hexdigest()
