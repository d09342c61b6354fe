"""torchrun's local elastic agent, with a controller and a dying gasp.

:class:`TrainguardAgent` subclasses torch's ``LocalElasticAgent``:

* after each rendezvous, the agent of node 0 starts the job's controller
  and publishes its address in the rendezvous store (never the job secret:
  the store has no authentication; every node has the secret from its own
  file or environment, see :mod:`trainguard.core.secret`); every agent
  starts a relay for its node's ranks (:mod:`trainguard.core.relay`) and
  hands the relay's address and the secret to its workers through the
  environment;
* when a worker dies, the agent reports it to the controller at once and
  lets the survivors finish what the controller tells them (a dying-gasp
  save, then exit) instead of killing them on the spot. Once every worker
  has exited, torch's usual restart logic (``--max-restarts``) applies, the
  group started again in warm standby processes (:mod:`.warm`) -- unless
  the dump followed the script's own exception;
* a worker found stopped (SIGSTOP, a frozen container: state ``T`` in
  ``/proc``) on two checks ``STOPPED_CONFIRM_S`` apart is a hang: the agent
  kills it and reports why, within a second instead of a heartbeat timeout;
* it owns the node's snapshot directory in shared memory
  (:mod:`trainguard.core.snapshot`), so in-memory snapshots outlive the
  workers that took them, and removes it when it exits; with several
  nodes it also keeps the previous node's copies (a peer server) and
  tells its workers where the next node's is, and mirrors its ranks'
  own-part records there (:mod:`.own_copies`);
* it takes the controller's orders (:mod:`.restart`): start a new process
  for one rank while the others keep running (recover-in-place for its own
  ranks, recover for another node's), kill one, lower the restart budget, or
  probe its links to other nodes (:mod:`trainguard.core.links`). Every
  restart counts against ``--max-restarts``, as torch's restarts do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import threading
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from trainguard.core import Controller, ControllerConfig, Strategy
from trainguard.core.config_launch import LaunchConfig
from trainguard.core.control.client import ControllerClient, find_controller
from trainguard.core.control.wire import agent_event_to_pb, agent_order
from trainguard.core.links import answer_probe
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.relay import Relay
from trainguard.core.secret import TLS
from trainguard.core.snapshot import SnapshotDir

from .node_servers import NodeServers
from .watch import FrozenWatch, report_exit, stop_controller
from .restart import Replacements
from .own_copies import ROUND_KEY, fetch_into
from .round_store import fresh_worker_store, publish_bootstrap
from .warm import WarmGroup, script_error

__all__ = ["TrainguardAgent"]

log = logging.getLogger("trainguard.launcher")

_ADDRESS_KEY = "trainguard/controller"
_ROUND_KEY = ROUND_KEY  # a random id of the round: the key of the peer servers' addresses
#: The controller's states between a fault and its outcome.
_HANDLING = ("ABNORMAL", "RECOVERING", "DUMPING")
#: How long the others of a round in which a rank failed before every rank
#: registered may take to leave by themselves (a setting every rank refuses
#: alike) before they are ended.
STARTING_GRACE_S = 3.0
#: How long workers still running after the job ended (the controller
#: EXITED) get before their agent stops them: every rank it still reached
#: was told to exit and does within its exit grace (10 s); one it had given
#: up for lost would otherwise wait in a collective for its timeout.
ENDED_GRACE_S = 15.0
#: How long the agent waits for the others at exit once a node agent was lost.
EXIT_BARRIER_AFTER_LOSS_S = 10
#: How often node 0 writes the controller's address to the store again.
REPUBLISH_S = 1.0


class TrainguardAgent(LocalElasticAgent):
    """Args: as ``LocalElasticAgent``, plus the controller's config, the
    launcher's settings (how many workers this agent may start for other
    nodes' ranks under ``recover``, warm standby, where snapshots go), the
    job secret and the control plane's TLS settings (see
    :mod:`trainguard.core.secret`)."""

    _published: tuple[Any, str, float] | None = None  # node 0 of several: (store, the controller's address, when)

    def __init__(self, *args: Any, controller_config: ControllerConfig, launch: LaunchConfig = LaunchConfig(),
                 secret: str, tls: TLS | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._config = controller_config
        self._launch = launch
        self._secret, self._tls = secret, tls
        self._key = secrets.token_bytes(16)  # proves to the controller that a relay of a new round is ours
        self._spare = launch.spare_slots
        self._orders: queue.Queue = queue.Queue()
        self.replacements: Replacements | None = None
        self.controller: Controller | None = None
        self.relay: Relay | None = None
        self._client: ControllerClient | None = None
        self._worker_store: dist.TCPStore | None = None
        self._failed_at: float | None = None
        self._ended_at: float | None = None  # when a failure's episode ended the job (see ENDED_GRACE_S)
        self._reported: set[int] = set()
        self._frozen = FrozenWatch()
        self._warm = WarmGroup()
        self.last_status: dict | None = None
        self.node = NodeServers(self._config.job_id, launch, secret, self._config.host, self._mirrored_ranks)

    # ----------------------------------------------------------- controller
    def _assign_worker_ranks(self, store, group_rank: int, group_world_size: int, spec) -> list:
        """torch's, after node 0 publishes the shared store's address in this
        round too (:func:`.round_store.publish_bootstrap`)."""
        if group_rank == 0:
            publish_bootstrap(store, spec)
        return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._failed_at, self._ended_at, self._reported = None, None, set()
        store = worker_group.store
        self._worker_store = fresh_worker_store(worker_group) or self._worker_store  # node 0 serves it
        world_size = worker_group.workers[0].world_size
        # First what every node publishes for the others (its peer server), so no node waits for another
        # that is still looking for the controller.
        if worker_group.group_rank == 0:
            store.set(_ROUND_KEY, secrets.token_hex(8))
        self.node.snapshots(worker_group, store, _ROUND_KEY)
        if worker_group.group_rank == 0:
            # The round is over (every worker here exited): the streams still open are
            # relays' that will be replaced, so no call needs the default second to finish.
            self.last_status, self.controller = stop_controller(self.controller, self.last_status, 0.1), None
            if worker_group.group_world_size > 1 and self._config.host in ("127.0.0.1", "localhost", "::1"):
                log.warning("the controller listens on %s: only agents on this host can reach it; for nodes "
                            "on other hosts pass --controller-host (or TRAINGUARD_HOST)", self._config.host)
            # One restart budget per job: process restarts and torch's
            # restarts of the whole group draw on --max-restarts alike.
            config = dataclasses.replace(self._config, max_restarts=self._remaining_restarts)
            self.controller = Controller(config, world_size, token=self._secret, tls=self._tls)
            address = self.controller.start()  # its own, never read back: anyone may write the store meanwhile
            store.set(_ADDRESS_KEY, address)
            self._published = (store, address, time.monotonic()) if worker_group.group_world_size > 1 else None
        else:  # the store's value is a hint: taken once the server there proved the secret
            self._published = None
            address = find_controller(lambda: store.get(_ADDRESS_KEY).decode(), self._secret, tls=self._tls)
        token = self._secret
        if self.relay is not None:
            self.relay.stop()
        if self.replacements is not None:
            self.replacements.close()
        self._orders = queue.Queue()
        # The node's ranks reach the controller through this agent's relay:
        # one stream per node instead of one per rank; it carries the
        # agent's orders too.
        hello = pb.AgentHello(ranks=[w.global_rank for w in worker_group.workers], spare=self._spare,
                              key=self._key, probe=self.node.sink(worker_group))
        self.relay = Relay(address, token, max_message_bytes=self._config.max_message_bytes, agent=hello,
                           on_order=self._orders.put, tls=self._tls)
        os.environ.update(TRAINGUARD_CONTROLLER=self.relay.start(), TRAINGUARD_TOKEN=token,
                          TRAINGUARD_JOB_ID=self._config.job_id)
        if self._client is not None:
            self._client.close()
        self._client = ControllerClient(address, token, tls=self._tls)

    @property
    def snapshot_dir(self) -> SnapshotDir | None:
        return self.node.snapshot_dir

    def _mirrored_ranks(self) -> list[int]:
        replacements = self.replacements
        return sorted(replacements.processes()) if replacements is not None else []

    def _own_copy(self, rank: int, step: int) -> str | None:
        """``rank``'s own part of ``step`` brought here from another host (see :func:`.own_copies.fetch_into`)."""
        return fetch_into(self._worker_group, self.snapshot_dir, self._secret, rank, step)

    def _probe_links(self, order: pb.AgentOrder) -> None:
        """A link survey's order, on a thread of its own: measure, answer."""
        event, relay = answer_probe(agent_order(order), self._secret), self.relay
        if relay is not None:
            relay.report(agent_event_to_pb(event))

    def shutdown_controller(self) -> None:
        """After the run: stop the relay, the controller (keeping its last
        status) and the peer server, and remove the node's snapshots."""
        if self.relay is not None:
            self.relay.stop()
            self.relay = None
        if self.replacements is not None:
            self.replacements.close()
            self.replacements = None
        self.last_status, self.controller = stop_controller(self.controller, self.last_status), None
        if self._client is not None:
            self._client.close()
            self._client = None
        self.node.close()
        self._warm.close()

    # ----------------------------------------------------------- group restarts
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """torch's, but a restarted group runs in warm standbys when it can
        (see :mod:`.warm`)."""
        previous = self._pcontext
        if previous is not None and self._launch.standby and "TORCHELASTIC_ENABLE_FILE_TIMER" not in os.environ:
            restart_count = worker_group.spec.max_restarts - self._remaining_restarts
            context = self._warm.start(previous, worker_group, restart_count, self._logs_specs,
                                       self._log_line_prefix_template)
            if context is not None:
                self._pcontext = context
                return context.pids()
        return super()._start_workers(worker_group)

    # ----------------------------------------------------------- monitoring
    def _republish(self) -> None:
        """Node 0: write the controller's address again every
        ``REPUBLISH_S``, so a node that found another value there (anyone
        may write the store) finds the true one on its next read."""
        if self._published is None or time.monotonic() - self._published[2] < REPUBLISH_S:
            return
        store, address, _ = self._published
        try:
            store.set(_ADDRESS_KEY, address)
        except Exception as e:  # noqa: BLE001 - torch's store raises many kinds; the job goes on without it
            log.debug("could not write the controller's address to the store again: %s", e)
        self._published = (store, address, time.monotonic())

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._republish()
        handlers = getattr(self._pcontext, "subprocess_handlers", None)
        if not handlers:
            return super()._monitor_workers(worker_group)
        if self.replacements is None or self.replacements.context is not self._pcontext:
            self.replacements = Replacements(self, worker_group, self._pcontext,
                                             standbys=self._warm.take if self._wants_standby() else None,
                                             own_copy=self._own_copy)
        self._take_orders()
        for event in self.replacements.ready():
            self.relay.report(event)
        procs = self.replacements.processes()  # global rank -> Popen, moved ranks left out
        codes = {rank: p.poll() for rank, p in procs.items()}
        for rank in [r for r, c in codes.items() if c is None]:
            reason = self._frozen.stopped(procs[rank].pid)
            if reason:
                # Report before killing: the kill also breaks the rank's
                # session, which alone would read as a plain lost process.
                self._reported.add(procs[rank].pid)
                self._report(rank, procs[rank].pid, -9, reason, self._frozen.running_at.get(procs[rank].pid, 0.0))
                procs[rank].kill()
                codes[rank] = procs[rank].wait()
        failed = {r: c for r, c in codes.items() if c not in (None, 0)}
        running = [r for r, c in codes.items() if c is None]
        for rank, code in failed.items():
            pid = procs[rank].pid
            if pid not in self._reported:
                self._reported.add(pid)
                self._report(rank, pid, code, last_running=self._frozen.last_poll)
        self._frozen.last_poll = time.time()
        if not failed:
            self._failed_at = None
        state = self._controller_state() if failed else None
        if getattr(self, "_remaining_restarts", 0) > 0 and self._launch.standby:  # (none without run())
            self._warm.keep(worker_group.spec.local_world_size, dumping=state in ("DUMPING", "EXITED"),
                            ranks_up=self.relay is None or set(procs) <= self.relay.connected,
                            for_a_rank=self._wants_standby())
        if failed and state == "INIT" and running:
            # A rank failed before every rank registered (while starting or
            # resuming): nothing can be recovered in place, and the others
            # may wait for it in a collective for good. End the round, as
            # torchrun does (its --max-restarts relaunches it), once the
            # others had a moment to finish refusing the same setting.
            now = time.monotonic()
            if self._failed_at is None:
                self._failed_at = now
                log.error("rank %s failed before every rank had registered with the controller (while starting "
                          "or resuming); ending ranks %s", sorted(failed)[:16], running[:16])
            if now - self._failed_at < STARTING_GRACE_S:
                return RunResult(state=WorkerState.HEALTHY)
            return super()._monitor_workers(worker_group)
        if running or (failed and state in _HANDLING):
            # Not torch's poll while anything runs: it ends every worker at the
            # first failure, and a failed rank may be restarted alone. Nor
            # when every rank here failed while the controller handles it: its
            # order (start one here, or the rank moved to another node) is on
            # the way, and a FAILED now would re-rendezvous, which makes every
            # other agent end its workers, survivors and their dump included.
            if not failed:
                return RunResult(state=WorkerState.HEALTHY)
            now = time.monotonic()
            if self._failed_at is None:
                self._failed_at = now
            if state == "EXITED" and self._ended_at is None:
                self._ended_at = now
            if self._ended_at is not None:
                if now - self._ended_at < ENDED_GRACE_S:
                    return RunResult(state=WorkerState.HEALTHY)
                log.warning("ranks %s still running %.0f s after the job ended; stopping them", running[:16],
                            now - self._ended_at)
            elif now - self._failed_at < self._grace_s():
                return RunResult(state=WorkerState.HEALTHY)
            elif running:
                log.error("ranks %s still running %.0f s after a failure; stopping them", running,
                          now - self._failed_at)
        result = super()._monitor_workers(worker_group)
        if result.state is WorkerState.FAILED and getattr(self, "_remaining_restarts", 0) > 0:
            self._no_restart_after_script_error()
        return result

    def _no_restart_after_script_error(self) -> None:
        """No restart of the group after a dump the script's own exception
        caused: it would meet the exception again (see :func:`.warm.script_error`)."""
        try:
            status = self.controller.snapshot() if self.controller is not None else self._client.status()
        except Exception:  # noqa: BLE001 - no controller: torch's rule stands
            return
        why = script_error(status)
        if why:
            log.warning("not restarting the group: %s", why)
            self._remaining_restarts = 0

    def _controller_state(self) -> str | None:
        """The job's controller state (``None``: it is gone and gives no more orders)."""
        try:
            return (self.controller.snapshot() if self.controller is not None else self._client.status())["state"]
        except Exception:  # noqa: BLE001 - any failure to reach it means the same
            return None

    def _exit_barrier(self) -> None:
        """torch's wait for every node's agent at the end. A node agent the
        controller saw go away, or whose ranks all run elsewhere now (its
        host was lost, frozen or cut off and ``recover`` moved them), may
        never arrive: wait briefly instead of 5 minutes, and say so in one
        line instead of torch's traceback (the fault's WARNING told the story)."""
        try:
            gone = (self.controller.snapshot() if self.controller is not None else self._client.status()
                    ).get("agents_gone", [])
        except Exception:  # noqa: BLE001 - no controller to ask: keep torch's wait
            gone = []
        if not gone:
            return super()._exit_barrier()
        self._exit_barrier_timeout = min(self._exit_barrier_timeout, EXIT_BARRIER_AFTER_LOSS_S)
        torch_log, start = logging.getLogger(LocalElasticAgent._exit_barrier.__module__), time.monotonic()
        level = torch_log.level
        torch_log.setLevel(logging.CRITICAL)
        try:
            super()._exit_barrier()
        finally:
            torch_log.setLevel(level)
        if time.monotonic() - start >= self._exit_barrier_timeout - 0.5:
            log.info("node agents %s are gone: the end-of-job barrier gave up on them", gone[:8])

    def _wants_standby(self) -> bool:
        restarts = {Strategy.RECOVER_IN_PLACE, Strategy.RECOVER} & set(self._config.strategies)
        return bool(restarts) and self._remaining_restarts > 0 and self._launch.standby and (
            Strategy.RECOVER_IN_PLACE in restarts or self._spare > 0)

    def _take_orders(self) -> None:
        while True:
            try:
                order = self._orders.get_nowait()
            except queue.Empty:
                return
            action = order.WhichOneof("action")
            if action == "start":
                failed = self.replacements.start(order)
                if failed is not None:
                    self.relay.report(failed)
            elif action == "kill":
                self.replacements.kill(order.kill)
            elif action == "moved":
                self.replacements.release(order.moved)
            elif action == "dropped":
                self.replacements.release(order.dropped)
            elif action == "probe":
                threading.Thread(target=self._probe_links, args=(order,), name="trainguard-link-probe",
                                 daemon=True).start()
            elif action == "restarts_left":
                self._remaining_restarts = min(self._remaining_restarts, order.restarts_left)

    def _grace_s(self) -> float:
        c = self._config
        return c.prelock_timeout_s + c.save_timeout_s + 2 * c.handler_timeout_s + 30

    def _report(self, rank: int, pid: int, code: int, reason: str = "", last_running: float = 0.0) -> None:
        report_exit(self.controller, self.relay, rank, pid, code, reason, last_running)
