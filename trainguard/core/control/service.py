"""The controller's gRPC service: a rank's session, a node relay's session
carrying all of that node's ranks, process-exit reports and status. It runs
on the :class:`~.server.Controller`'s event loop, the only thread that
touches :class:`~.controller.ControllerCore`."""

from __future__ import annotations

import asyncio
import json
import logging
from functools import partial
from typing import AsyncIterator, Callable

import grpc

from ..agent_messages import AgentOrder
from ..api import ProtocolError
from ..commands import Command
from .controller import ControllerCore
from ..protocol import trainguard_pb2 as pb
from .routing import END, Abort, NodeLink, call_exit_refusal, check_agent, dispatch, exit_refusal
from ..handshake import ServerAuth
from ..rpc import Refusals, Refused, empty_stream, validate_rank_message
from .wire import Hellos, Wired, agent_event, agent_hello, agent_order_to_pb

__all__ = ["Service"]

log = logging.getLogger("trainguard.controller")


class Service:
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
