"""The controller's gRPC server, run on its own event-loop thread.

One asyncio loop serves every session (a rank's own, or a node relay's
carrying all of that node's ranks; see :mod:`trainguard.core.relay`) and is
the only thread that touches :class:`~.controller.ControllerCore`, in the
core's own types (:mod:`.wire` translates). Launchers use :class:`Controller`,
safe to call from any thread; :mod:`.routing` has the ways back to ranks and
nodes, and the checks on what node agents send."""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Future
from functools import partial
from typing import Any, AsyncIterator, Callable

import grpc

from ..agent_messages import AgentOrder
from ..api import ControllerState, ProtocolError, TrainguardError
from ..commands import Command
from ..loop import LoopThread
from ..config import ControllerConfig
from .controller import ControllerCore
from .heap import Heap
from ..profiling.live import LiveDetector
from ..protocol import trainguard_pb2 as pb
from .routing import END, Abort, NodeLink, call_exit_refusal, check_agent, dispatch, exit_refusal
from ..handshake import Authenticate, ServerAuth
from ..proof import Names
from ..rpc import SERVICE, Refusals, Refused, decoder, empty_stream, validate_rank_message
from ..secret import TLS, new_token
from .wire import Hellos, Wired, agent_event, agent_hello, agent_order_to_pb

__all__ = ["Controller"]

log = logging.getLogger("trainguard.controller")

_TICK_S = 0.05

class _Service:
    """The ``Control`` service; every method runs on the controller's loop.

    A rank is reached through its own session or through its node's relay;
    ``routes`` maps each connected rank to the way that reaches it.
    """

    def __init__(self, core: ControllerCore, token: str) -> None:
        self.core = core
        self.routes: dict[int, Callable[[pb.Command], None]] = {}
        self.agents: dict[str, NodeLink] = {}  # node agents, by the node name of their relay
        self.agent_keys: dict[str, bytes] = {}  # the key each name was first announced with
        self.stopping = False  # set while the server shuts down: ended sessions are not lost ranks
        self.refusals = Refusals(log, "controller")
        self.auth = ServerAuth(token, None, self.refusals, cap=max(4096, 2 * core.world_size))
        self.grpc_limit = max(4 * core.config.max_message_bytes, 4 << 20)  # gRPC's own, on the server (_serve)
        self.welcome = pb.ControllerMessage(welcome=pb.Welcome(
            job_id=core.config.job_id, heartbeat_interval_s=core.heartbeat_interval_s))
        self.wired, self.hellos = Wired(), Hellos(core.world_size)  # a command made protobuf once, a group parsed once

    def deliver(self, rank: int, command: Command) -> None:
        route = self.routes.get(rank)
        if route is None:
            log.debug("no session for rank %d; dropping command %d", rank, command.id)
            return
        route(self.wired(command))

    def order(self, node: str, order: AgentOrder) -> None:
        link = self.agents.get(node)
        if link is None:
            log.warning("no relay for node agent %s; dropping order %d", node, order.id)
            return
        link.queue.put_nowait(pb.NodeCommands(orders=[agent_order_to_pb(order)]))

    def _restore_route(self, rank: int, previous) -> None:
        if previous is None:
            self.routes.pop(rank, None)
        else:
            self.routes[rank] = previous

    def _ended(self, rank: int, route, *, goodbye: bool) -> None:
        """A rank's session is over; without Goodbye its process is lost."""
        if self.routes.get(rank) is route:
            del self.routes[rank]
            if not goodbye and not self.stopping:
                self.core.on_disconnect(rank)

    async def _refuse(self, context, code: grpc.StatusCode, reason: str) -> None:
        self.refusals(context.peer(), code, reason)
        await context.abort(code, f"trainguard: {reason}")

    # ------------------------------------------------------- one rank, one stream
    async def session(self, requests: AsyncIterator, context) -> AsyncIterator[pb.ControllerMessage]:
        stream = requests.__aiter__()
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            self.refusals(context.peer(), grpc.StatusCode.INVALID_ARGUMENT, empty_stream(self.grpc_limit))
            return
        if isinstance(first, Refused):
            await self._refuse(context, first.code, first.reason)
        rank = first.hello.rank
        queue: asyncio.Queue = asyncio.Queue()
        route = queue.put_nowait
        try:
            validate_rank_message(first, world_size=self.core.world_size, first=True)
            # Routed before the core hears of it: registering a rank can send
            # it commands at once (a replacement completes a phase).
            previous = self.routes.get(rank)
            self.routes[rank] = route
            try:
                self.core.on_hello(self.hellos(first.hello))
            except ProtocolError:
                if self.routes.get(rank) is route:
                    self._restore_route(rank, previous)
                raise
        except ProtocolError as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        state = {"goodbye": False}
        reader = asyncio.ensure_future(self._read(rank, stream, queue, state))
        try:
            yield self.welcome
            while True:
                item = await queue.get()
                if item is END:
                    break
                if isinstance(item, Abort):
                    await self._refuse(context, item.code, f"rank {rank}: {item.reason}")
                yield pb.ControllerMessage(command=item)
        finally:
            reader.cancel()
            self._ended(rank, route, goodbye=state["goodbye"])

    async def _read(self, rank: int, stream, queue: asyncio.Queue, state: dict) -> None:
        """Feed the rank's messages to the core; end the session (``END``)
        after Goodbye, when the stream breaks, or on a controller bug."""
        try:
            async for msg in stream:
                if isinstance(msg, Refused):
                    queue.put_nowait(Abort(msg.code, msg.reason))
                    return
                body = validate_rank_message(msg, world_size=self.core.world_size, first=False)
                dispatch(self.core, rank, body, msg)
                if body == "goodbye":
                    state["goodbye"] = True
                    break
        except ProtocolError as e:
            queue.put_nowait(Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
            return
        except asyncio.CancelledError:
            raise
        except grpc.RpcError:
            pass  # the stream broke: the session's finally clause reports the loss
        except Exception:  # a bug in the controller must not take the server down
            log.exception("controller error while handling rank %d", rank)
        queue.put_nowait(END)

    # ------------------------------------------------------- a node's ranks, one stream
    async def node_session(self, requests: AsyncIterator, context) -> AsyncIterator[pb.NodeCommands]:
        link, local, seen = NodeLink(), {}, {}
        reader = asyncio.ensure_future(self._read_node(requests, link, local, context.peer(), seen))
        try:
            while True:
                item = await link.queue.get()
                if item is END:
                    break
                if isinstance(item, Abort):
                    await self._refuse(context, item.code, item.reason)
                yield item
        finally:
            reader.cancel()
            for rank, route in list(local.items()):
                self._ended(rank, route, goodbye=False)
            node = seen.get("agent")
            if node is not None and self.agents.get(node) is link:
                del self.agents[node]
                if not self.stopping:
                    self.core.on_agent_lost(node)

    async def _read_node(self, requests, link: NodeLink, local: dict, peer: str, seen: dict) -> None:
        try:
            async for msg in requests:
                if isinstance(msg, Refused):
                    link.queue.put_nowait(Abort(msg.code, msg.reason))
                    return
                node = msg.node or peer
                if msg.HasField("agent"):
                    abort = check_agent(node, msg.agent, self.core.world_size, self.agent_keys)
                    if abort is not None:
                        link.queue.put_nowait(abort)
                        return
                    seen["agent"] = node
                    self.agents[node] = link
                    self.core.on_agent(node, agent_hello(msg.agent))
                for event in msg.events:
                    if seen.get("agent") == node:
                        self.core.on_agent_event(node, agent_event(event))
                for exit_ in msg.exits:
                    self._agent_exit(seen.get("agent"), node, exit_)
                for item in msg.items:
                    self._node_item(item, link, local, msg.node or peer)
        except asyncio.CancelledError:
            raise
        except grpc.RpcError:
            pass  # the relay went away: every rank it carried is lost
        except Exception:  # a bug in the controller must not take the server down
            log.exception("controller error while handling node %s", peer)
        link.queue.put_nowait(END)

    def _node_item(self, item: pb.RankEnvelope, link: NodeLink, local: dict, node: str) -> None:
        rank = item.rank
        if item.disconnected:
            if rank in local:
                self._ended(rank, local.pop(rank), goodbye=False)
            return
        try:
            first = rank not in local
            body = validate_rank_message(item.message, world_size=self.core.world_size, first=first)
            if first:
                if item.message.hello.rank != rank:
                    raise ProtocolError(f"envelope for rank {rank} carries a Hello for rank {item.message.hello.rank}")
                # Routed before the core hears of it (see session()); any
                # command it sends at once travels in the welcome's batch.
                previous, route = self.routes.get(rank), partial(link.send, rank)
                self.routes[rank] = route
                try:
                    self.core.on_hello(self.hellos(item.message.hello))
                except ProtocolError:
                    self._restore_route(rank, previous)
                    raise
                local[rank] = route
                link.send(rank, self.welcome)
                return
            dispatch(self.core, rank, body, item.message)
            if body == "goodbye":
                self._ended(rank, local.pop(rank), goodbye=True)
        except ProtocolError as e:
            self.refusals(node, grpc.StatusCode.INVALID_ARGUMENT, f"rank {rank}: {e}")
            link.refuse(rank, str(e))
            if rank in local:  # a rank that breaks the protocol mid-session is dropped
                self._ended(rank, local.pop(rank), goodbye=False)

    def _agent_exit(self, agent: str | None, node: str, report: pb.ProcessExit) -> None:
        """A worker's exit, from the node agent that runs it and from no one else."""
        refusal = exit_refusal(self.core, agent, node, report)
        if refusal is not None:
            self.refusals(node, grpc.StatusCode.PERMISSION_DENIED, refusal)
            return
        self.core.on_process_exit(report.rank, report.pid, report.exit_code, report.reason[:2000],
                                  report.last_running)

    async def report_process_exit(self, request, context) -> pb.Ack:
        if isinstance(request, Refused):
            await self._refuse(context, request.code, request.reason)
        refusal = call_exit_refusal(self.core, request)
        if refusal is not None:
            await self._refuse(context, *refusal)
        self.core.on_process_exit(request.rank, request.pid, request.exit_code, request.reason[:2000],
                                  request.last_running)
        return pb.Ack()

    async def get_status(self, request, context) -> pb.JobStatus:
        snap = self.core.snapshot()
        return pb.JobStatus(job_id=snap["job_id"], state=snap["state"], json=json.dumps(snap))


class Controller(LoopThread):
    """The job's controller, served from a background thread.

    Args:
        config: bind address, strategies, timeouts.
        world_size: number of ranks that will register.
        token: the job secret; a fresh one is made when omitted.
        tls: serve mutual TLS with these (see :mod:`.secret`); plain gRPC
            when omitted.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, config: ControllerConfig, world_size: int, *, token: str | None = None,
                 tls: TLS | None = None) -> None:
        if world_size < 1:
            raise TrainguardError(f"world_size must be >= 1, got {world_size}")
        self.config = config
        self.world_size = world_size
        self.token = token or new_token()
        self.tls = tls
        self.address = ""
        self._server: Any = None
        self._service: _Service | None = None
        self._core: ControllerCore | None = None
        self._live: LiveDetector | None = None
        self._heap = Heap(world_size)

    thread_name = "trainguard-controller"

    def start(self) -> str:
        """Bind, start serving and return ``host:port``.

        Raises:
            TrainguardError: the address could not be bound.
        """
        port = self._start_loop(timeout_s=30)
        host = self.config.host
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("controller listening on %s for %d ranks", self.address, self.world_size)
        self._live = LiveDetector.from_env(self.config.job_id, self.world_size)
        if self._live is not None:
            core, loop = self._core, self._loop
            self._live.on_job_wide = lambda finding: loop.call_soon_threadsafe(
                core.survey_links, f"step {finding.step}: {finding.reason}")
            self._core.journal.slow_nodes = self._live.start()
            log.info("live slow-node detection follows %s", self._live.job_dir)
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        if self._live is not None:
            self._live.stop()
        super().stop(grace_s)
        self._heap.release()

    async def _serve(self, ready: Future) -> None:
        self._core = ControllerCore(self.config, self.world_size, send=lambda r, c: self._service.deliver(r, c),
                                    send_agent=lambda n, o: self._service.order(n, o))
        self._service = _Service(self._core, self.token)
        limit = self.config.max_message_bytes
        handlers = {
            "Session": grpc.stream_stream_rpc_method_handler(
                self._service.session, request_deserializer=decoder(pb.RankMessage, limit),
                response_serializer=pb.ControllerMessage.SerializeToString),
            "ReportProcessExit": grpc.unary_unary_rpc_method_handler(
                self._service.report_process_exit, request_deserializer=decoder(pb.ProcessExit, limit),
                response_serializer=pb.Ack.SerializeToString),
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                self._service.get_status, request_deserializer=decoder(pb.StatusRequest, limit),
                response_serializer=pb.JobStatus.SerializeToString),
            "NodeSession": grpc.stream_stream_rpc_method_handler(
                self._service.node_session, request_deserializer=decoder(pb.NodeMessage, limit),
                response_serializer=pb.NodeCommands.SerializeToString),
            "Handshake": self._service.auth.handler(),
        }
        # Every rank opens its session at about the same moment; gRPC's default
        # cap on calls waiting to be accepted (1000) would cancel the rest.
        pending = max(4096, 2 * self.world_size)
        self._server = grpc.aio.server(interceptors=[
            Authenticate(self._service.auth, frozenset({"Session", "NodeSession"}))], options=[
            ("grpc.max_receive_message_length", self._service.grpc_limit),
            ("grpc.so_reuseport", 0),
            # No growing receive windows (gRPC's BDP probe): a call is received, up to its window, before its
            # secret is checked, and 100 unauthenticated 4 MiB calls cost 60-140 MiB with them, 1-3 without
            # (bench/preauth.py); control messages fit the fixed 64 KiB window (bench/scale.py is no slower).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", pending),
        ])
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        host = self.config.host
        bind = f"[{host}]:{self.config.port}" if ":" in host else f"{host}:{self.config.port}"
        try:
            port = self._server.add_secure_port(bind, self.tls.server()) if self.tls is not None else \
                self._server.add_insecure_port(bind)
        except RuntimeError as e:
            raise TrainguardError(f"controller could not bind {bind}: {e}") from None
        # A client proves the secret for the address it dialed: only this server's own are accepted (under TLS
        # the certificates prove the server).
        self._service.auth.names = Names(host, port) if self.tls is None else None
        await self._server.start()
        ready.set_result(port)
        while True:
            await asyncio.sleep(_TICK_S)
            try:
                self._core.tick()
                self._heap.tick(self._core.state)
            except Exception:
                log.exception("controller tick failed")

    def report_process_exit(self, rank: int, pid: int, code: int, reason: str = "", last_running: float = 0.0) -> None:
        """Tell the controller a worker process exited (from a node agent);
        ``reason`` when the agent ended it (a stopped process, say);
        ``last_running``: when the agent last saw it running."""
        self._call(lambda: self._core.on_process_exit(rank, pid, code, reason, last_running))

    def snapshot(self) -> dict:
        return self._call(lambda: json.loads(json.dumps(self._core.snapshot())))

    @property
    def state(self) -> ControllerState:
        return self._call(lambda: self._core.state)

    async def _shutdown(self, grace_s: float) -> None:
        self._service.stopping = True
        await self._server.stop(grace_s)  # ends every call; stop() then cancels the ticks (_serve)

    def __enter__(self) -> "Controller":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
