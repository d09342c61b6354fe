"""The persist worker: a process beside each trainer that seals its
snapshots and writes them to storage, so the training loop never waits on a
disk.

The trainer talks to it with JSON lines on the worker's stdin and reads
replies on its stdout (:class:`~.persist_client.PersistWorker` is that
side). Requests:

* ``seal``: record the checksum (XXH3-64) of a slot's payload (and push the slot to the
  peer node's agent when one is named); a seal of a slot the trainer has
  written again since is dropped. Seals asked before the trainer died are
  still done: a restarted trainer loads sealed snapshots only.
* ``persist``: write a slot's payload (from its mapping) as one file of a checkpoint's temporary directory, with the checksum it was
  sealed with, and leave a record of it there; the
  finalising rank's worker then waits until every expected file's record
  is there and finalises (manifest, rename, tracker last).

A persist that fails (the store is full, read-only, gone, or fails I/O) is
answered ``ok: False`` with the reason and the step the tracker names (the
newest complete checkpoint, untouched); the trainer goes on and
:class:`~.health.PersistHealth` tells once per streak of such failures. A file that
could not be written leaves an empty ``.failed`` record (it needs no data
block, so it gets through to a full store), and the finalising worker gives
up on the step at once and removes its temporary directory
(:mod:`.records`). So it does for a file a survivor marked lost (its writer
died before it wrote it): that reply says ``abandoned``, not a failure of
the store.

Nothing the worker does is on the training loop's path, and it runs at a
lower CPU priority than the trainer (:data:`NICE`). If it is killed,
the trainer starts another and the checkpoint it was writing is simply
never finalised; if the trainer is killed, the worker finishes the
persists already asked of it and exits.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import logs
from ..api import CheckpointError
from ..checkpoint import MEGATRON, MINDSPORE, TORCH, CheckpointStore, FileInfo, io_error
from ..config import PersistConfig
from .persist_client import PersistWorker
from .records import FAILED, GIVE_UP_GRACE_S, LOST, RECORDS, Leftover, Leftovers, record_path, write_record
from .segment import Mappings, Slot, State

__all__ = ["PersistWorker"]

log = logging.getLogger("trainguard.snapshot")

NAMINGS = {"torch": TORCH, "megatron": MEGATRON, "mindspore": MINDSPORE}
#: How much lower than its trainer's the worker's CPU priority is (``nice``).
NICE = 10
#: How long a finalising worker whose trainer died still waits for the other shards.
ORPHAN_GRACE_S = 5.0


# --------------------------------------------------------------------- worker
class _Superseded(CheckpointError):
    """A newer step is final already: this one is not needed (not a failure of the store)."""


class _Abandoned(CheckpointError):
    """A file of the step will never be written: its writer was lost (not a failure of the store)."""


def _persist(req: dict, parent: int, sealing: Future | None = None, pushed: Future | None = None,
             maps: Mappings | None = None, *, store: CheckpointStore | None = None,
             leftovers: Leftovers | None = None) -> dict:
    """Write the slot's payload as a checkpoint file; ``sealing``: the seal of
    that slot already under way on the seal thread (its checksum is taken
    instead of hashing again), ``pushed``: that seal's whole task, peer push
    included, waited for before the file counts as written (so a step on
    storage is in the peer's memory too, as when seals ran in line);
    ``maps``: the worker's slot mappings; ``store``: the store (default:
    the one the request names); ``leftovers``: where a finaliser that gave
    up leaves the step to remove (default: removed at once). A failure is
    the reply (see :func:`_failed`), not an exception: the trainer tells of
    it."""
    step, name, fin = req["step"], req["name"], req.get("finalize")
    if store is None:
        # The finaliser prunes to the job's `keep`, which the adapters send with the finalise request.
        store = CheckpointStore(req["root"], NAMINGS[req["naming"]], keep=(fin or {}).get("keep", req.get("keep", 0)))
    try:
        written = _write(req, store, sealing, pushed, maps)
        write_record(store, step, written)
        reply = {"ok": True, "file": [written.name, written.bytes, written.sha256, written.xxh3], "final": None}
        if fin:
            reply["final"] = str(_finalise(store, step, fin, parent))
        return reply
    except (CheckpointError, OSError) as e:  # (an OSError here is the slot's: the store's are CheckpointErrors)
        return _failed(store, step, name, fin, e, leftovers)


def _finalise(store: CheckpointStore, step: int, fin: dict, parent: int) -> Path:
    tmp = store.tmp_path(step)
    files = _await_records(tmp, fin["expected"], fin.get("timeout_s", 1800.0), parent, store, step)
    try:
        shutil.rmtree(tmp / RECORDS)
    except OSError as e:
        raise io_error(f"removing {tmp / RECORDS}", e) from None
    return store.finalize(step, files, layout=fin.get("layout"), meta=fin.get("meta"), rehash=False)


def _failed(store: CheckpointStore, step: int, name: str, fin: dict | None, error: Exception,
            leftovers: Leftovers | None = None) -> dict:
    """The reply to a persist of ``step`` that failed, once what it leaves is
    dealt with: a finaliser (``fin``) has the step's temporary directory
    removed, and any older one (see :class:`Leftovers`), so a full store
    gets its space back at once rather than at the next finalise; another
    rank records its file as failed, so the finaliser stops waiting for it.
    A step that is final already (a dying gasp of the same or a newer step)
    is left alone: its directory is not this save's. Unlike
    :meth:`CheckpointStore.finalize`, nothing is kept for inspection: the
    next finalise would remove it anyway."""
    newest = store.tracked_step()
    if fin and (newest is None or newest < step):
        later = Leftover(store, step, [record_path(store.tmp_path(step), n) for n in fin["expected"] if n != name],
                          time.monotonic() + GIVE_UP_GRACE_S)
        if leftovers is None:
            later.remove()
        else:
            leftovers.add(later)
    elif not fin and (newest is None or newest <= step):
        try:
            write_record(store, step, FileInfo(name, -1, ""))
        except CheckpointError:  # the finaliser waits its timeout (or fails on the store itself)
            pass
    return {"ok": False, "error": str(error), "superseded": isinstance(error, _Superseded),
            "abandoned": isinstance(error, _Abandoned), "last_complete": newest}


def _write(req: dict, store: CheckpointStore, sealing: Future | None, pushed: Future | None,
           maps: Mappings | None) -> FileInfo:
    """:func:`_persist`'s file: the slot's payload, with the checksum it was sealed with."""
    step, name = req["step"], req["name"]
    _not_superseded(store, step)
    slot = Slot(Path(req["slot"]), maps)
    try:
        slot.lock(False, block=True)
        info = slot.info()
        if info is None or info.step != step or info.state not in (State.COMPLETE, State.SEALED):
            raise CheckpointError(f"slot {slot.path.name} no longer holds step {step}")
        payload = slot.payload()
        try:
            if info.state is State.SEALED:
                written = store.copy_file(step, name, payload, info.checksum)
            else:
                # Seal while the copy runs: the checksum pass and the writes both run outside the GIL.
                with ThreadPoolExecutor(1) as pool:
                    if sealing is None:
                        sealing = pool.submit(slot.seal)
                    written = store.copy_file(step, name, payload, None)
                    sealed = sealing.result()
                if sealed is None or sealed.step != step:  # the seal thread could not (rare): seal here
                    sealed = slot.seal()
                if sealed is None:
                    raise CheckpointError(f"slot {slot.path.name} holds no complete snapshot of step {step}")
                written = dataclasses.replace(written, xxh3=sealed.checksum)
            if pushed is not None:
                pushed.result()
        finally:
            payload.release()
    finally:
        slot.close()
    return written


def _not_superseded(store: CheckpointStore, step: int) -> None:
    """Raises _Superseded when a newer step is final already (a dying
    gasp that overtook this save): finalising this one would move the
    tracker back, and the newer one's finalise removed its other files."""
    newest = store.tracked_step()
    if newest is not None and newest > step:
        raise _Superseded(f"step {step} not finalised: the newer step {newest} is final already")


def _await_records(tmp: Path, expected: list[str], timeout_s: float, parent: int,
                   store: CheckpointStore, step: int) -> list[FileInfo]:
    deadline, orphaned = time.monotonic() + timeout_s, None
    while True:
        _not_superseded(store, step)
        paths = [record_path(tmp, n) for n in expected]
        failed = [n for n, p in zip(expected, paths) if p.with_suffix(FAILED).exists()]  # see write_record
        if failed:
            raise CheckpointError(f"{tmp.name}: {failed[:4]} could not be written; not finalised")
        lost = [n for n, p in zip(expected, paths) if p.with_suffix(LOST).exists() and not p.is_file()]
        if lost:
            raise _Abandoned(f"{tmp.name}: {lost[:4]} will never be written (their writer was lost); not finalised")
        if all(p.is_file() for p in paths):
            try:
                return [FileInfo(*json.loads(p.read_text())) for p in paths]
            except OSError as e:
                raise io_error(f"reading the records in {tmp}", e) from None
        now = time.monotonic()
        if orphaned is None and os.getppid() != parent:
            orphaned = now
        missing = [n for n, p in zip(expected, paths) if not p.is_file()]
        if now > deadline or (orphaned is not None and now - orphaned > ORPHAN_GRACE_S):
            raise CheckpointError(f"{tmp.name}: {missing[:4]} never arrived; not finalised")
        time.sleep(0.05)


def _seal(req: dict, sealed: Future, maps: Mappings | None = None, token: str = "") -> dict:
    """Seal the slot; ``sealed`` gets its :class:`Info` (``None`` when it
    could not) as soon as the checksum is recorded, before any peer push
    (with the job secret ``token``)."""
    slot = Slot(Path(req["slot"]), maps)
    try:
        if not slot.lock(False):
            return {"skipped": "being written"}
        info = slot.info()
        if info is None or info.step != req["step"]:
            return {"skipped": "written again since"}
        done = slot.seal()
        sealed.set_result(done)
        if done is None:
            return {"skipped": "not complete"}
        # The push goes without the lock, so a slow link never holds the
        # trainer up; a copy torn by a new snapshot fails the peer's
        # checksum and is refused there.
        slot.unlock()
        if req.get("peer"):
            from .peer import push
            push(req["peer"], slot, rank=req["rank"], token=token)
        return {"xxh3": done.checksum}
    finally:
        if not sealed.done():
            sealed.set_result(None)
        slot.close()


def _serve(stdin: Any, stdout: Any, config: PersistConfig) -> None:
    """Requests in order on this thread; seals (and their peer pushes) on a
    second one, so a persist of a slot being sealed writes the file while
    the checksum pass runs, and takes its result."""
    parent = config.parent_pid
    todo: collections.deque = collections.deque()
    cond, out_lock = threading.Condition(), threading.Lock()
    done = threading.Event()
    sealing: dict[str, tuple[Future, Future]] = {}  # slot -> (its seal's Info, the seal task with its push)
    # The trainer's slots stay mapped between requests: each is sealed and
    # maybe persisted at every snapshot (a 1 GB slot: 0.2 s to map and unmap).
    maps = Mappings()
    leftovers = Leftovers()

    def read() -> None:
        for line in stdin:
            with cond:
                todo.append(json.loads(line))
                cond.notify()
        with cond:
            done.set()
            cond.notify()

    def answer(req: dict, run: Any) -> None:
        try:
            reply = run()
        except (CheckpointError, OSError, ValueError, KeyError) as e:
            log.error("%s of step %s failed: %s", req["op"], req.get("step"), e)
            reply = {"ok": False, "error": str(e)}
        reply.setdefault("ok", True)
        reply.update(id=req["id"], op=req["op"], step=req.get("step"))
        try:
            with out_lock:
                stdout.write(json.dumps(reply) + "\n")
                stdout.flush()
        except (BrokenPipeError, ValueError):  # the trainer is gone; go on with what it asked
            pass

    threading.Thread(target=read, daemon=True).start()
    with ThreadPoolExecutor(1, thread_name_prefix="seal") as seals:
        while True:
            with cond:
                while not todo and not done.is_set():
                    cond.wait(0.1 if leftovers.pending else None)
                    leftovers.check()
                if not todo:
                    break
                req = todo.popleft()
                newer = any(r["slot"] == req["slot"] for r in todo)
            if req["op"] == "seal":
                if newer:
                    answer(req, lambda: {"skipped": "superseded"})
                else:
                    sealed: Future = Future()
                    seal = lambda r=req, f=sealed: _seal(r, f, maps, config.token)  # noqa: E731
                    sealing[req["slot"]] = (sealed, seals.submit(answer, req, seal))
            else:
                sealed, task = sealing.pop(req["slot"], (None, None))
                answer(req, lambda: _persist(req, parent, sealed if sealed and not sealed.done() else None, task,
                                             maps, leftovers=leftovers))
                leftovers.check()
    leftovers.check(last=True)
    maps.close()


def main() -> None:
    # Below the trainer, threads included (they inherit it): seals and writes take the cores training
    # leaves. At the trainer's priority, on a CPU host whose cores its OpenMP threads fill, a training
    # step beside the persist of a 1 GB state took 2.5-4.2 s instead of 0.6-0.9; at +10, 0.79 s, with
    # the persist done as soon (bench/checkpoint.py's synthetic state).
    os.nice(NICE)
    config = PersistConfig.from_env()
    logging.basicConfig(level=logs.level(config.log_level), format=f"[persist {config.rank}] %(levelname)s %(message)s")
    _serve(sys.stdin, sys.stdout, config)


if __name__ == "__main__":
    main()
