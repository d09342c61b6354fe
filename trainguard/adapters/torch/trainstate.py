"""Everything a rank must get back to continue exactly where it was.

:class:`TrainState` groups the objects the user registered (model,
optimizer, LR scheduler, grad scaler, data position, extras) and keeps a
*commit snapshot* taken at the end of every step: module buffers (mutated by
forward passes, e.g. BatchNorm statistics), the scheduler, scaler and data
positions, and the RNG streams. Parameters and optimizer state are not
copied (too big, and the update window protects them); everything a failed
step may have touched before its update is restored from the snapshot.
"""

from __future__ import annotations

import array
import copy
import random
import sys
from typing import Any, Mapping

import torch
from torch.nn.parallel import DistributedDataParallel

from .data import resumable
from .scaler import ScalerState, is_scaler

__all__ = ["TrainState", "unwrap"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _portable(rng: dict) -> dict:
    """RNG streams as tensors and JSON scalars (what a checkpoint holds)."""
    version, internal, gauss = rng["python"]
    words = torch.frombuffer(array.array("q", internal), dtype=torch.int64).clone()  # 5x torch.tensor(tuple)'s speed
    out = {"torch": rng["torch"], "python": {"version": version, "state": words, "gauss": gauss}}
    if "cuda" in rng:
        out["cuda"] = list(rng["cuda"])
    if "numpy" in rng:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        out["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached": float(cached)}
    return out


def _from_portable(saved: dict) -> dict:
    python = saved["python"]
    rng = {"torch": saved["torch"].cpu(),
           "python": (python["version"], tuple(python["state"].tolist()), python["gauss"])}
    if "cuda" in saved and torch.cuda.is_available():
        rng["cuda"] = [t.cpu() for t in saved["cuda"]]
    if "numpy" in saved and "numpy" in sys.modules:
        n = saved["numpy"]
        rng["numpy"] = (n["name"], n["keys"].cpu().numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"])
    return rng


class TrainState:
    """The registered training objects and their last commit snapshot.

    Args:
        model: the module (DDP-wrapped or not).
        optimizer: the (unwrapped) optimizer.
        scheduler, scaler, data: optional objects with ``state_dict`` /
            ``load_state_dict``; ``data`` may also be a torchdata
            ``StatefulDataLoader`` (:func:`.data.resumable`), and a
            ``torch.amp`` GradScaler is carried with its per-optimizer
            state (:class:`.scaler.ScalerState`).
        extra: more named stateful objects to save and repair.
        sharded: the model is sharded (``fully_shard``): the state dicts
            hold each DTensor's local shard, put back into DTensors on load
            (:mod:`.fsdp`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scheduler: Any = None,
                 scaler: Any = None, data: Any = None, extra: Mapping[str, Any] | None = None,
                 rank: int = 0, sharded: bool = False) -> None:
        self.module = unwrap(model)
        self.sharded = sharded
        self.rank = rank
        self.optimizer = optimizer
        data = resumable(data)  # a StatefulDataLoader: with its sampler's epoch; a plain DataLoader: refused
        #: The GradScaler given, carried whole (its stage and found-inf per optimizer too).
        self.scaler = ScalerState(scaler, {"optimizer": optimizer}) if is_scaler(scaler) else None
        if self.scaler is not None:
            scaler = self.scaler
        self.host: dict[str, Any] = {k: v for k, v in
                                     {"scheduler": scheduler, "scaler": scaler, "data": data, **(extra or {})}.items()
                                     if v is not None}
        for name, obj in self.host.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{name} must have state_dict() and load_state_dict()")
        self._buffer_names = [n for n, _ in self.module.named_buffers()]
        self.snapshot: dict[str, Any] | None = None
        self.snapshot_step: int | None = None
        self.rng_loaded = False  # whether the last load_state_dict set this rank's RNG streams
        self._own_rng: dict | None = None  # the streams the last own_part() took

    # ------------------------------------------------------------ snapshots
    def commit(self, step: int) -> None:
        """Record the state at the end of ``step`` (cheap: buffers, small dicts,
        RNG). The buffers are copied into the last commit's copies where they
        still fit: no allocation, and a snapshot finds them where it found
        them last (:mod:`.snapshot` starts its copies before its walk)."""
        buffers = dict(self.module.named_buffers())
        now = [buffers[n].detach() for n in self._buffer_names]
        kept = self.snapshot["buffers"] if self.snapshot is not None else {}
        if now and list(kept) == self._buffer_names and all(
                k.shape == t.shape and k.dtype == t.dtype and k.device == t.device for k, t in zip(kept.values(), now)):
            with torch.no_grad():
                torch._foreach_copy_(list(kept.values()), now)
        else:
            kept = {n: t.clone() for n, t in zip(self._buffer_names, now)}
        self.snapshot = {
            "buffers": kept,
            "host": {k: copy.deepcopy(v.state_dict()) for k, v in self.host.items()},
            "rng": _rng_state(),
        }
        self.snapshot_step = step

    def restore_buffers(self) -> None:
        """Undo what forward passes since the last commit did to buffers."""
        if self.snapshot is None:
            return
        buffers = dict(self.module.named_buffers())
        with torch.no_grad():
            for name, saved in self.snapshot["buffers"].items():
                buffers[name].copy_(saved)

    def restore_host(self) -> None:
        """Put scheduler, scaler, data position and RNG back to the commit."""
        if self.snapshot is None:
            return
        for name, obj in self.host.items():
            obj.load_state_dict(copy.deepcopy(self.snapshot["host"][name]))
        self.restore_rng()

    def restore_rng(self) -> None:
        if self.snapshot is not None:
            _set_rng_state(self.snapshot["rng"])

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict:
        """The state as it is now (sharded: this rank's shards)."""
        return {
            **self.model_and_optimizer(),
            "host": {k: v.state_dict() for k, v in self.host.items()},
        }

    def committed_state_dict(self) -> dict:
        """The state at the last commit: current parameters and optimizer
        (unchanged since, outside an update) with the snapshot's buffers and
        host objects, and this rank's RNG streams under ``rng.<rank>``."""
        state = self.state_dict()
        if self.snapshot is not None:
            state["model"].update(self.snapshot["buffers"])
            state["host"] = copy.deepcopy(self.snapshot["host"])
            state["rng"] = self.committed_rng()
        return state

    def committed_rng(self) -> dict:
        """This rank's RNG streams at the last commit, as ``{"<rank>": streams}``."""
        return {str(self.rank): _portable(self.snapshot["rng"])} if self.snapshot is not None else {}

    # ------------------------------------------------------------ own part
    def own_part(self) -> dict:
        """What this rank does not share with its replicas, as it is now:
        its random streams and its data position (each reads its own shard)."""
        self._own_rng = _rng_state()
        return self._own(self._own_rng, self.host["data"].state_dict() if "data" in self.host else None)

    def committed_own(self) -> dict:
        """:meth:`own_part` at the last commit."""
        if self.snapshot is None:
            return self.own_part()
        return self._own(self.snapshot["rng"], self.snapshot["host"].get("data"))

    def _own(self, rng: dict, data: Any) -> dict:
        own: dict[str, Any] = {"rng": {str(self.rank): _portable(rng)}}
        if data is not None:
            own["data"] = copy.deepcopy(data)
        return own

    def streams_moved(self) -> bool:
        """Whether the random streams of the last commit differ from those
        of the last :meth:`own_part` (something drew after the update began)."""
        if self.snapshot is None or self._own_rng is None:
            return True
        a, b = self.snapshot["rng"], self._own_rng
        if not torch.equal(a["torch"], b["torch"]) or a["python"] != b["python"]:
            return True
        if "numpy" in a or "numpy" in b:
            if "numpy" not in a or "numpy" not in b or a["numpy"][2:] != b["numpy"][2:] or \
                    not (a["numpy"][1] == b["numpy"][1]).all():
                return True
        return any(not torch.equal(x, y) for x, y in zip(a.get("cuda", ()), b.get("cuda", ())))

    def load_own(self, own: Mapping[str, Any]) -> None:
        """Set this rank's random streams and data position from ``own``
        (this rank's, from :meth:`own_part`); the commit snapshot follows.

        Raises:
            KeyError: ``own`` holds no streams of this rank.
        """
        _set_rng_state(_from_portable(own["rng"][str(self.rank)]))
        if "data" in own and "data" in self.host:
            self.host["data"].load_state_dict(own["data"])
        self.rng_loaded = True
        if self.snapshot is not None:
            self.snapshot["rng"] = _rng_state()
            if "data" in own and "data" in self.host:
                self.snapshot["host"]["data"] = copy.deepcopy(own["data"])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a state produced by :meth:`state_dict` (or
        :meth:`committed_state_dict`) here or on a replica. This rank's RNG
        streams are set when the state holds them (a replica's are not
        taken: data-parallel ranks may draw from streams of their own).

        Raises:
            KeyError/RuntimeError: the state does not fit these objects.
        """
        model, optimizer = state["model"], state["optimizer"]
        if self.sharded:
            from .fsdp import optimizer_with_specs, with_specs
            model, optimizer = with_specs(model, self.module.state_dict()), optimizer_with_specs(optimizer,
                                                                                               self.optimizer)
        with torch.no_grad():
            self.module.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        missing = set(self.host) - set(state.get("host", {}))
        if missing:
            raise KeyError(f"state lacks {sorted(missing)}")
        for name, obj in self.host.items():
            obj.load_state_dict(state["host"][name])
        own = state.get("rng", {}).get(str(self.rank))
        self.rng_loaded = own is not None
        if own is not None:
            _set_rng_state(_from_portable(own))

    def pieces(self) -> dict:
        """What a rehearsal compares besides the model and the own part, as
        at the last commit: ``optimizer``, ``lr`` (every group's learning
        rate), ``scheduler``, ``scaler`` and ``extra:<name>`` for each extra."""
        host = self.snapshot["host"] if self.snapshot is not None else {k: v.state_dict() for k, v in self.host.items()}
        out = {"optimizer": self.optimizer.state_dict(), "lr": [g["lr"] for g in self.optimizer.param_groups]}
        for name, state in host.items():
            if name != "data":
                out[name if name in ("scheduler", "scaler") else f"extra:{name}"] = state
        return out

    def model_and_optimizer(self) -> dict:
        state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.sharded:
            from .fsdp import local
            return local(state)
        return state
