"""Starting one worker again while the others keep running.

torch's agent keeps a node's workers in one process context and ends all of
them at the first failure. :class:`Replacements` lets the
:class:`~.agent.TrainguardAgent` restart a single rank instead:

* **recover-in-place** -- a new process for one of this node's ranks takes
  the failed one's slot in torch's context (same entry point, arguments,
  environment and log files), so torch's own monitoring, log tailing and
  shutdown cover it like the original;
* **recover** -- a new process for another node's rank runs beside this
  node's workers (a *spare slot*), with the rank's identity
  (``RANK``) and the next free local rank.

With a restart strategy enabled the agent keeps warm *standby* processes
(:mod:`.standby`: torch already imported; the pool :mod:`.warm` also keeps
for a restart of the whole group) and hands one the rank's environment and
command line, which saves the interpreter start and the imports
(``TRAINGUARD_STANDBY=off`` starts cold).

The new process finds its peers on a fresh store this agent serves (the
job's store holds the old rendezvous keys of the default group, which a new
process must not read) and learns from ``TRAINGUARD_JOIN`` that it joins a
running job: the survivors meet it on that store (see the torch adapter's
``join`` module).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler, get_subprocess_handler
from torch.distributed.elastic.utils import macros

from trainguard.core.protocol import trainguard_pb2 as pb

from .standby import command_for, handler_for

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

__all__ = ["Replacements"]

#: A new process that has not reached its rendezvous by then is announced anyway.
READY_TIMEOUT_S = 120.0

log = logging.getLogger("trainguard.launcher")


class Replacements:
    """The restartable workers of one rendezvous round.

    Args:
        agent: the node agent (for its host name and spec).
        group: this round's worker group.
        context: torch's process context holding the group's workers.
        standbys: hands out a warm standby process for a restart (``None``
            when none waits), or ``None``: restarts start cold.
    """

    def __init__(self, agent: Any, group: "WorkerGroup", context: Any, *,
                 standbys: Callable[[], subprocess.Popen | None] | None = None, own_copy: Any = None) -> None:
        self.context = context
        # (rank, step) -> None, or why the rank's own part of that step cannot be had on this node
        self._own_copy = own_copy
        self._group = group
        self._local = {w.global_rank: w.local_rank for w in group.workers}
        self._adopted: dict[int, Any] = {}  # other nodes' ranks run here: global rank -> handler
        self._moved: set[int] = set()  # this node's ranks now run elsewhere
        self._stores: list[dist.TCPStore] = []
        self._starting: dict[int, tuple] = {}  # rank -> (order, handler, store or None, address), not yet ready
        self._host = group.master_addr if group.group_rank == 0 else (group.spec.local_addr or socket.getfqdn())
        self._standbys = standbys if command_for(context.entrypoint, context.args[0]) is not None else None

    def _launch(self, args: tuple, env: dict[str, str], stdout: str | None, stderr: str | None,
                local_rank: int) -> SubprocessHandler:
        """Start a worker: in the standby when one is ready (and the worker's
        output is not redirected to files), else as torch starts one."""
        ctx = self.context
        command = command_for(ctx.entrypoint, args)
        standby = self._standbys() if self._standbys is not None and command is not None and not stdout \
            and not stderr else None
        if standby is not None:
            argv, module = command
            try:
                standby.stdin.write(json.dumps({"env": {**os.environ, **env}, "argv": argv, "module": module}) + "\n")
                standby.stdin.close()
            except OSError:
                log.warning("the standby process is gone; starting the worker cold")
            else:
                return handler_for(standby, local_rank)
        return get_subprocess_handler(entrypoint=ctx.entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                                      local_rank_id=local_rank)

    def processes(self) -> dict[int, Any]:
        """Every worker this agent is responsible for: global rank -> Popen."""
        procs = {rank: self.context.subprocess_handlers[lr].proc for rank, lr in self._local.items()
                 if rank not in self._moved}
        procs.update({rank: h.proc for rank, h in self._adopted.items()})
        return procs

    def start(self, order: pb.AgentOrder) -> pb.AgentEvent | None:
        """Start a new process for ``order.start.rank``. The answer (its pid
        and the store it will rendezvous on) comes from :meth:`ready` once it
        reached its rendezvous; only a failure to start answers at once."""
        start = order.start
        rank = start.rank
        if rank in self._local:
            self._moved.discard(rank)  # a rank elastic training dropped comes back here
        elif start.step >= 0 and self._own_copy is not None:
            # Another node's rank: its random streams and data position come from the copy another host
            # keeps, or the new process would go on from its seed (not the job a fault-free run trains).
            why = self._own_copy(rank, start.step)
            if why:
                log.error("not starting rank %d here: %s", rank, why)
                return pb.AgentEvent(rank=rank, order=order.id, ok=False, message=why)
        try:
            self._end(rank)
            store = None
            if start.join_store:  # several new processes meet on the first one's store
                host, _, port = start.join_store.rpartition(":")
            else:
                store = dist.TCPStore(host_name=self._host, port=0, is_master=True, multi_tenant=True,
                                      wait_for_workers=False)
                self._stores.append(store)
                host, port = self._host, str(store.port)
            join = {"generation": start.generation, "step": start.step}
            handler = self._spawn(rank, {"MASTER_ADDR": host, "MASTER_PORT": port,
                                         "TORCHELASTIC_USE_AGENT_STORE": "True",
                                         "TRAINGUARD_JOIN": json.dumps(join)})
        except Exception as e:  # answered to the controller, which falls back
            log.exception("could not start a new process for rank %d", rank)
            return pb.AgentEvent(rank=rank, order=order.id, ok=False, message=f"{type(e).__name__}: {e}")
        # INFO: a restart in place is the default way back; the controller's one WARNING tells the fault's story.
        log.info("started pid %d for rank %d (joining generation %d at step %d)", handler.proc.pid, rank,
                    start.generation, start.step)
        self._starting[rank] = (order, handler, store, f"{host}:{port}", time.monotonic() + READY_TIMEOUT_S)
        return None

    def ready(self) -> list[pb.AgentEvent]:
        """Answers for started processes: at once when a recovery waits for
        them; when scaling back up, once they reached their rendezvous (the
        first key in their store: they sit in ``init_process_group``, waiting
        for the others), so the others train meanwhile. A process that died
        first is answered as a failure."""
        events = []
        for rank, (order, handler, store, address, deadline) in list(self._starting.items()):
            code = handler.proc.poll()
            if code is not None:
                events.append(pb.AgentEvent(rank=rank, order=order.id, ok=False,
                                            message=f"pid {handler.proc.pid} exited with code {code} before it joined"))
            elif store is None or order.start.step >= 0 or store.num_keys() > 0 or time.monotonic() > deadline:
                # A recovery's survivors wait anyway: they may meet it at once.
                # Scaling back up (step -1) pauses the others only when it is there.
                events.append(pb.AgentEvent(rank=rank, order=order.id, ok=True, pid=handler.proc.pid,
                                            join_store=address))
            else:
                continue
            del self._starting[rank]
        return events

    def _spawn(self, rank: int, extra_env: dict[str, str]) -> Any:
        ctx = self.context
        lr = self._local.get(rank)
        if lr is not None and rank not in self._moved:
            env = {**ctx.envs[lr], **extra_env}
            handler = self._launch(ctx.args[lr], env, ctx.stdouts[lr], ctx.stderrs[lr], lr)
            # torch's context now watches the new process in the old one's place.
            ctx.subprocess_handlers[lr] = handler
            ctx._running_local_ranks.add(lr)
            ctx._failures.pop(lr, None)
            self._group.workers[lr].id = handler.proc.pid
            return handler
        # Another node's rank, in a spare slot: the next local rank after ours.
        local_rank = self._group.spec.local_world_size + len(self._adopted)
        env = {**ctx.envs[0], "RANK": str(rank), "ROLE_RANK": str(rank), "LOCAL_RANK": str(local_rank),
               **extra_env}
        env.pop("TORCHELASTIC_ERROR_FILE", None)  # that file is local rank 0's
        args = tuple(macros.substitute(list(self._group.spec.args), str(local_rank)))
        handler = self._launch(args, env, None, None, local_rank)
        self._adopted[rank] = handler
        return handler

    def _end(self, rank: int) -> None:
        """Make sure the rank's previous process here is gone."""
        proc = self.processes().get(rank)
        if proc is not None and proc.poll() is None:
            log.warning("killing pid %d of rank %d before starting its replacement", proc.pid, rank)
            proc.kill()
            proc.wait(timeout=30)

    def kill(self, rank: int) -> None:
        """End the rank's replacement here (its recovery was abandoned)."""
        proc = self.processes().get(rank)
        if proc is not None and proc.poll() is None:
            log.warning("killing pid %d of rank %d: its recovery was abandoned", proc.pid, rank)
            proc.kill()

    def release(self, rank: int) -> None:
        """The rank runs under another agent now, or the job goes on without
        it (elastic training): its process here (dead) is no failure of this
        node."""
        lr = self._local.get(rank)
        if lr is None:
            return
        self._moved.add(rank)
        self.context._running_local_ranks.discard(lr)
        self.context._failures.pop(lr, None)

    def close(self) -> None:
        """End adopted workers (the round is over), and the join stores."""
        for handler in self._adopted.values():
            if handler.proc.poll() is None:
                handler.close()
        self._adopted.clear()
        self._stores.clear()
