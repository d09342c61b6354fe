"""A process group whose collectives can be released and whose backend can
be replaced while the process keeps running.

When a peer fails, the healthy ranks sit inside a collective until the
backend's timeout (gloo: 30 minutes). Aborting a gloo group does not release
such a call (measured on torch 2.13), so :class:`AbortableProcessGroup`
never lets the training thread wait on a backend call directly: every
collective is issued asynchronously on the *inner* backend and the caller
waits on a future that trainguard completes -- with the result when the
backend finishes, or with :class:`~trainguard.core.ForceStop` when the
controller says STOP. A fresh backend is then built among the ranks for the
next generation and the abandoned one destroyed (see :meth:`replace_backend`).

DDP uses it through a comm hook (:func:`allreduce_hook`), so its reducer
waits on trainguard's future rather than in C++ on the backend.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d

from trainguard.core import ForceStop

from .work import Work

__all__ = ["AbortableProcessGroup", "run_cancellable"]

log = logging.getLogger("trainguard.torch")

BackendFactory = Callable[[Any, int, int, timedelta], Any]

#: How long the interpreter's exit waits for backends still being retired.
RETIRE_AT_EXIT_S = 5.0

_live: "weakref.WeakSet[AbortableProcessGroup]" = weakref.WeakSet()
_retiring: set[threading.Thread] = set()


class AbortableProcessGroup(dist.ProcessGroup):
    """A process group over a replaceable inner backend.

    Args:
        store: the rendezvous store all ranks share (the default group's).
        rank, size: this rank and the world size.
        backend_factory: builds an inner backend ``(store, rank, size,
            timeout)``; gloo when omitted.
        timeout: the inner backend's own timeout (only reached when no STOP
            releases a call, e.g. with no controller).
        namespace: store prefix; must differ between job restarts.
        abort: called with the inner backend on STOP (NCCL needs its
            communicator aborted to free the device; gloo needs nothing).
        generation: the generation to build first (a process joining a
            running job builds the one the survivors rebuild).
        members: the global ranks in the group (default: all ``size``);
            ``rank`` is global and the group numbers members from 0
            (elastic training drops ranks).
        build: build the backend now; otherwise the first :meth:`rebuild`
            does (off the calling thread, so it can be abandoned).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        *,
        backend_factory: BackendFactory | None = None,
        timeout: timedelta = timedelta(minutes=30),
        namespace: str = "trainguard",
        abort: Callable[[Any], None] | None = None,
        generation: int = 0,
        members: Sequence[int] | None = None,
        build: bool = True,
    ) -> None:
        self.members = tuple(members) if members is not None else tuple(range(size))
        if rank not in self.members:
            raise ValueError(f"rank {rank} is not among the group's members {list(self.members)[:16]}")
        super().__init__(self.members.index(rank), len(self.members))
        self._store = store
        self._rank, self._size = self.members.index(rank), len(self.members)
        self._factory = backend_factory or (lambda s, r, n, t: dist.ProcessGroupGloo(s, r, n, t))
        self._timeout = timeout
        self._namespace = namespace
        self._abort = abort
        self._pending: set[Work] = set()
        self._halted = False
        self._black_hole = False
        self.generation = generation
        #: Told of every collective issued: ``observer(op, args, work)`` (profiling markers).
        self.observer: Callable[[str, tuple, Any], None] | None = None
        self._inner = self._build(generation) if build else None
        _live.add(self)

    # ------------------------------------------------------------ lifecycle
    def _build(self, generation: int) -> Any:
        prefix = dist.PrefixStore(f"{self._namespace}/pg/{generation}/", self._store)
        return self._factory(prefix, self._rank, self._size, self._timeout)

    def stop(self, reason: str = "stopped by the controller") -> None:
        """Fail every pending collective the backend has not completed
        (:meth:`Work.release`) and refuse new ones until :meth:`rebuild`.
        Safe to call from any thread."""
        self._halted = True
        for work in list(self._pending):
            work.release(reason)
        if self._abort is not None and self._inner is not None:
            self._abort(self._inner)

    def group_rank(self, rank: int) -> int:
        """This group's number for global ``rank``."""
        return self.members.index(rank)

    @property
    def timeout(self) -> timedelta:
        """The inner backend's own timeout."""
        return self._timeout

    @property
    def busy(self) -> bool:
        """Whether any collective is in flight."""
        return bool(self._pending)

    @property
    def halted(self) -> bool:
        return self._halted

    def rebuild(self, generation: int, cancelled: Callable[[], bool] = lambda: False, store: Any = None,
                *, quiet: bool = False) -> None:
        """Replace the inner backend with a fresh one (every rank calls this
        with the same ``generation``), on ``store`` from now on when given
        (a new process joined on a store of its own).

        The build runs on a helper thread so that a new STOP (``cancelled()``
        turning true) can abandon a build whose peers never arrive.

        Raises:
            ForceStop: ``cancelled()`` turned true before the build finished.
        """
        for work in list(self._pending):
            work.finish(error=ForceStop("process group rebuilt"))
        self._black_hole = False
        if store is not None:
            self._store = store
        self.replace_backend(run_cancellable(lambda: self._build(generation), cancelled,
                                             f"rebuild of process group generation {generation}"))
        self.generation = generation
        self._halted = False
        log.log(logging.DEBUG if quiet else logging.INFO, "rank %d: process group rebuilt (generation %d)",
                self._rank, generation)

    def replace_backend(self, backend: Any) -> None:
        """Put ``backend`` (None: nothing) in place of the inner one, and
        destroy the one it replaces off the calling (training) thread.

        Its calls may still be pending (issued before the STOP, never matched
        by a faulty peer). ``abort()`` does not release them under gloo, and
        leaving them until exit makes gloo run their callbacks while Python
        finalizes, which aborts the process. The destructor does release them:
        it runs without the GIL, waits for in-flight calls and closes the
        sockets, so every rank destroying its copy at the same rebuild frees
        all of them within milliseconds (the rank that issued fewest calls
        has none pending and closes first). A peer that is frozen or cut off
        never closes its end: that destructor waits for gloo's own timeout.

        So the retiring thread must hold the only reference: a local variable
        still naming the old backend when that thread lets go would run its
        destructor here instead, and block recovery on the frozen peer.
        """
        holder, self._inner = [self._inner], backend
        if holder[0] is not None:
            def retire() -> None:
                holder.clear()
                _retiring.discard(thread)
            thread = threading.Thread(target=retire, name="trainguard-pg-retire", daemon=True)
            _retiring.add(thread)
            thread.start()

    def close(self) -> None:
        """Destroy the inner backend now (the destructor releases the GIL and
        joins its threads) and refuse collectives from then on; not while a
        call is in flight (it would wait for the peer that never answered)."""
        if not self._pending:
            self._halted, self._inner = True, None

    # ------------------------------------------------------------ collectives
    def black_hole(self) -> None:
        """Fault injection: from now until :meth:`rebuild`, collectives are
        never sent and never complete (a STOP fails them), as over a
        black-holed link."""
        self._black_hole = True

    def _issue(self, op: str, *args: Any, result: Any) -> Work:
        if self._black_hole and not self._halted:
            work = Work(self, None, result)
            self._pending.add(work)
            return work
        if self._halted:
            work = Work(self, None, result)
            work.finish(error=ForceStop(f"{op} refused: the process group is stopped"))
            return work
        work = Work(self, getattr(self._inner, op)(*args), result)
        if self.observer is not None:
            self.observer(op, args, work)
        return work

    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._issue("allreduce", tensors, opts, result=tensors)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._issue("broadcast", tensors, opts, result=tensors)

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._issue("allgather", output_tensors, input_tensors, opts, result=output_tensors)

    def _allgather_base(self, output, input, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._issue("_allgather_base", output, input, opts, result=[output])

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue("reduce_scatter", output_tensors, input_tensors, opts, result=output_tensors)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._issue("_reduce_scatter_base", output, input, opts, result=[output])

    # torch 2.13's all_gather_into_tensor and reduce_scatter_tensor call these names
    def all_gather_single(self, output, input, opts=None):
        return self._allgather_base(output, input, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_base(output, input, opts)

    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._issue("barrier", opts, result=[])

    def send(self, tensors, dst, tag=0):
        return self._issue("send", tensors, dst, tag, result=tensors)

    def recv(self, tensors, src, tag=0):
        return self._issue("recv", tensors, src, tag, result=tensors)

    def all_gather_json(self, obj: Any, device: torch.device = torch.device("cpu")) -> list[Any]:
        """Every rank's JSON-able ``obj``, in rank order (for small metadata).

        ``device`` is where the backend wants tensors (cuda for NCCL)."""
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self._size)]
        self.allgather([lengths], [torch.tensor([data.numel()], dtype=torch.int64, device=device)]).wait()
        sizes = [int(t.item()) for t in lengths]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.zeros(max(sizes), dtype=torch.uint8, device=device) for _ in range(self._size)]
        self.allgather([out], [padded.to(device)]).wait()
        return [json.loads(o[:n].cpu().numpy().tobytes()) for o, n in zip(out, sizes)]

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return "trainguard"

    def name(self) -> str:
        return "trainguard"


@atexit.register
def _close_at_exit() -> None:
    """Close every group on gloo and give backends being retired
    :data:`RETIRE_AT_EXIT_S`, while their threads can still take the GIL: a
    gloo thread still running Python (a collective's callback, the release
    of a tensor it held) once the interpreter finalizes aborts the process
    ("terminate called without an active exception"). NCCL's are left to
    its own exit; a controller's exit command ends the process before this."""
    for group in [g for g in _live if isinstance(g._inner, dist.ProcessGroupGloo)]:
        group.close()
    deadline = time.monotonic() + RETIRE_AT_EXIT_S
    for thread in list(_retiring):
        thread.join(max(0.0, deadline - time.monotonic()))


def run_cancellable(fn: Callable[[], Any], cancelled: Callable[[], bool], what: str) -> Any:
    """``fn()`` on a helper thread (a backend build blocks until every peer
    arrives), abandoned when ``cancelled()`` turns true (a new STOP).

    Raises:
        ForceStop: cancelled before ``fn`` returned; ``fn``'s own error.
    """
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = fn()
        except Exception as e:  # surfaced on the calling thread below
            done["error"] = e

    thread = threading.Thread(target=run, name="trainguard-pg-build", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.05)
        if cancelled() and thread.is_alive():
            raise ForceStop(f"{what} abandoned")
    if "error" in done:
        raise done["error"]
    return done["value"]
