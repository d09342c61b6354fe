"""Which random operators of a network keep their state inside MindSpore's kernels.

A retry sets back every random stream trainguard can read
(:func:`.state.streams`): Python's, NumPy's, MindSpore's generator, and the
op-seed table from which the functional operators (``ops.dropout``,
``ops.randn``...) take each call's seeds. A random primitive that was given
its seeds when it was built (``nn.Dropout``'s ``ops.Dropout``), or that
takes none at all, draws from a generator inside its kernel, which MindSpore
offers no way to read or set: after a fault, steps there draw other numbers
than a run without it. :func:`kernel_random_ops` finds them, without a
list of operators, from what MindSpore says of each primitive and, where
it says nothing, from what the primitive does:

* **held primitives**: every primitive a cell of the network holds;
* **functional calls**: every MindSpore function a cell's ``construct``
  names (``ops.dropout2d``, ``F.dropout1d``...), followed into the functions
  and primitive classes it names in turn. A function that takes each call's
  seeds from the op-seed table or the generator (``_get_seed``,
  ``default_generator``) draws from streams trainguard keeps, in PyNative
  mode; in graph mode its seeds are fixed when the graph compiles.

A primitive keeps random state in its kernel when MindSpore marks it
random -- a seed attribute (``seed``, ``seed2``, ``Seed0``...: seeds fixed
when it was built) or ``side_effect_hidden`` (hidden state), unless its
seeds are inputs of each call -- or, unmarked, when it is not the pure
function MindSpore's missing effect annotations declare it: a fresh
instance run twice on the same small input, with the same streams, returns
two different results (MindSpore 2.10 marks neither ``Dropout2D`` nor
``Dropout3D``, which ``nn.Dropout1d/2d/3d`` and ``ops.dropout1d/2d/3d``
use). Primitives MindSpore marks with an effect (a collective's group, a
write to memory, I/O) are never run; a fresh instance has a kernel of its
own, so the probe draws nothing from the network's.
"""

from __future__ import annotations

import dis
import inspect
import re
import types
from typing import Any, Iterator

import numpy as np
from mindspore import Tensor, nn
from mindspore.ops.primitive import Primitive

from .state import set_streams, streams

__all__ = ["kernel_random_ops"]

#: A seed given when the primitive was built.
_SEED = re.compile(r"^[Ss]eed\d*$")
#: Names a MindSpore function takes each call's seeds from (the op-seed table, the generator).
_PER_CALL_SEEDS = {"_get_seed", "default_generator"}
#: Effects MindSpore declares on a primitive that must never be run for a probe.
_EFFECTS = ("side_effect_mem", "side_effect_io", "side_effect_propagate", "no_eliminate")
#: Inputs the probe tries, each rank once: channels enough that two random masks agree by chance with
#: p < 2**-60, shapes a network is unlikely to use (a fresh kernel of the network's shape would share its state).
_SHAPES = ((183,), (3, 61), (3, 61, 1), (3, 61, 1, 1), (3, 61, 1, 1, 1))
#: How far into MindSpore's functions a ``construct``'s call is followed.
_DEPTH = 3


def kernel_random_ops(network: nn.Cell, *, graph: bool = False) -> list[str]:
    """The random operators of ``network`` whose state stays inside a
    kernel: ``path.attribute`` for a primitive a cell holds, ``path (calls
    name)`` for a function its ``construct`` calls (``graph``: compiled in
    graph mode, where every random operator's seeds are fixed)."""
    probe = _Probe(graph)
    found = []
    kept = streams()  # building a primitive may take op seeds: the network's draws stay as without the Guard
    try:
        for path, cell in network.cells_and_names():
            for attr, prim in vars(cell).get("_primitives", {}).items():
                if isinstance(prim, Primitive) and probe.held(prim):
                    found.append(f"{path}.{attr}" if path else attr)
            for name in probe.construct_calls(type(cell)):
                found.append(f"{path or type(cell).__name__} (calls {name})")
    finally:
        set_streams(kept)
    return found


class _Probe:
    """Verdicts, cached per primitive class and arguments and per function."""

    def __init__(self, graph: bool) -> None:
        self.graph = graph
        self._classes: dict[tuple, bool] = {}
        self._functions: dict[Any, bool] = {}
        self._constructs: dict[type, list[str]] = {}

    # ---------------------------------------------------------- primitives
    def held(self, prim: Primitive) -> bool:
        """Whether ``prim``, built once and called on each step, keeps random state in its kernel."""
        if any(_SEED.match(a) for a in prim.attrs):
            return True
        return self.kind(type(prim), _arguments(prim))

    def kind(self, cls: type, init: dict) -> bool:
        """Whether a primitive of ``cls`` built with ``init`` draws from state in its kernel."""
        key = (cls, tuple(sorted((k, repr(v)) for k, v in init.items())))
        if key not in self._classes:
            self._classes[key] = self._judge(cls, init)
        return self._classes[key]

    def _judge(self, cls: type, init: dict) -> bool:
        try:
            prim = cls(**init)
        except Exception:  # noqa: BLE001 - needs arguments we cannot guess: nothing to judge
            return False
        attrs = dict(prim.attrs)
        if "side_effect_hidden" in attrs:
            return not _seeds_per_call(prim)
        if any(_SEED.match(a) for a in attrs):
            return True
        if any(a in attrs for a in _EFFECTS) or isinstance(attrs.get("group"), str):  # never run one
            return False
        return _draws_twice_differently(cls, init)

    # ----------------------------------------------------------- functions
    def construct_calls(self, cls: type) -> list[str]:
        """The MindSpore functions ``cls.construct`` calls that draw from kernel state."""
        if cls not in self._constructs:
            construct = inspect.unwrap(getattr(cls, "construct", None) or (lambda: None))
            self._constructs[cls] = sorted({name for name, fn in _named(construct)
                                            if isinstance(fn, types.FunctionType) and _mindspore(fn)
                                            and self.function(fn, _DEPTH)})
        return self._constructs[cls]

    def function(self, fn: types.FunctionType, depth: int) -> bool:
        """Whether calling ``fn`` (a MindSpore function) draws from kernel state."""
        if fn in self._functions:
            return self._functions[fn]
        self._functions[fn] = False  # a recursive call judges nothing twice
        named = list(_named(fn))
        per_call = any(part in _PER_CALL_SEEDS for name, _ in named for part in name.split("."))
        verdict = False
        for _, obj in named:
            if isinstance(obj, type) and issubclass(obj, Primitive) and obj is not Primitive:
                if per_call and not self.graph:
                    continue  # built with this call's seeds from streams trainguard keeps
                verdict = self.kind(obj, {}) or (per_call and self.graph and self._random(obj))
            elif isinstance(obj, types.FunctionType) and _mindspore(obj) and depth > 1:
                verdict = self.function(obj, depth - 1)
            if verdict:
                break
        self._functions[fn] = verdict
        return verdict

    def _random(self, cls: type) -> bool:
        """Whether MindSpore marks ``cls`` random (graph mode: its seeds are then fixed at compile time)."""
        try:
            attrs = cls().attrs
        except Exception:  # noqa: BLE001
            return False
        return "side_effect_hidden" in attrs or any(_SEED.match(a) for a in attrs)


def _arguments(prim: Primitive) -> dict:
    """The arguments ``prim`` was built with, as far as it keeps them (by
    the names of its class's ``__init__``)."""
    try:
        names = [n for n in inspect.signature(type(prim).__init__).parameters if n != "self"]
    except (TypeError, ValueError):
        return {}
    out = {}
    for name in names:
        if name in vars(prim):
            out[name] = vars(prim)[name]
        elif name in prim.attrs:
            out[name] = prim.attrs[name]
    return out


def _mindspore(fn: types.FunctionType) -> bool:
    return (getattr(fn, "__module__", "") or "").startswith("mindspore.")


def _seeds_per_call(prim: Primitive) -> bool:
    """Whether ``prim`` takes its seeds as inputs of each call (from the
    generator or the op seeds its caller reads), not from its kernel."""
    names = set(prim.attrs.get("input_names", None) or ())
    if not names:
        try:
            names = set(inspect.signature(type(prim).__call__).parameters)
        except (TypeError, ValueError):
            names = set()
    return bool(names & {"seed", "offset"})


def _draws_twice_differently(cls: type, init: dict) -> bool:
    """Run a fresh ``cls(**init)`` twice on the same input of each rank in
    turn (the process's streams set back between and after): whether the
    first input it takes gives two different results."""
    kept = streams()
    try:
        prim = cls(**init)
        for shape in _SHAPES:
            x = Tensor(np.ones(shape, np.float32))
            try:
                first = _arrays(prim(x))
                set_streams(kept)
                second = _arrays(prim(x))
            except Exception:  # noqa: BLE001 - not this input: try the next rank
                continue
            return first != second
        return False
    finally:
        set_streams(kept)


def _arrays(out) -> list[tuple]:
    """``out``'s values as comparable bytes (a shape or a dtype by their text)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    arrays = [o.asnumpy() if hasattr(o, "asnumpy") else np.asarray(o) for o in outs]
    return [(a.dtype.str, a.shape, a.tobytes() if a.dtype != object else repr(a.tolist())) for a in arrays]


def _named(fn) -> Iterator[tuple[str, Any]]:
    """Every global a function's code names, and each attribute chain off it
    (``ops.dropout2d``, ``NN_OPS.Dropout2D``), resolved: ``(dotted name,
    object)``; nested functions' code included."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    scope = getattr(fn, "__globals__", {})
    stack = [code]
    while stack:
        code = stack.pop()
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        name, obj = "", None
        for ins in dis.get_instructions(code):
            if ins.opname == "LOAD_GLOBAL":
                if name:
                    yield name, obj
                name, obj = ins.argval, scope.get(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and name and obj is not None:
                yield name, obj
                name, obj = f"{name}.{ins.argval}", getattr(obj, ins.argval, None)
            elif name:
                yield name, obj
                name, obj = "", None
        if name:
            yield name, obj
