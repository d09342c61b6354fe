"""A node's relay: the sessions of every rank on a node over one stream.

A 16k-rank job has 16k processors; if each held its own session, one fault
would cost the controller ~50k messages (a STOP, a stopped report and a plan
command per rank). The node agent runs a :class:`Relay` instead: the node's
ranks open their ordinary ``Session`` to it, and it carries them all over one
``NodeSession`` to the controller, in batches. A phase's command reaches a
node as one message listing its ranks.

* Rank messages are forwarded within ``batch_window_s`` (a few ms), in order
  per rank; heartbeats wait up to ``heartbeat_window_s`` so a node's
  heartbeats travel together (a newer message of the same rank replaces a
  waiting heartbeat: it carries the status too).
* A rank whose session ends without Goodbye is reported ``disconnected``.
* If the controller stream ends, every local session ends: the ranks learn
  at once that no recovery can be coordinated.
* Ranks prove the job secret to the relay, and the relay to the
  controller, each after the server proved it (:mod:`.handshake`): the
  secret itself never travels.
* A relay run by a node agent also carries the agent's side: it announces
  the ranks the agent runs (``AgentHello``), hands the controller's orders
  (start a replacement process, kill one, the restart budget) to
  ``on_order`` and sends the agent's answers (:meth:`report`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from concurrent.futures import Future
from typing import AsyncIterator, Callable

import grpc

from .api import TrainguardError
from .handshake import Authenticate, Impostor, ServerAuth, alogin, method_path
from .loop import LoopThread
from .proof import Names
from .protocol import trainguard_pb2 as pb
from .rpc import SERVICE, Refusals, Refused, decoder, empty_stream
from .secret import TLS

__all__ = ["Relay"]

log = logging.getLogger("trainguard.relay")

_END = object()


class _Refusal:
    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        self.code, self.reason = code, reason


class Relay(LoopThread):
    """Args:
        controller: the controller's ``host:port``.
        token: the job token.
        host, port: where local ranks connect (loopback, any free port).
        node: a name for this node in the controller's logs.
        max_message_bytes: size limit of one message, each way.
        agent: the node agent's announcement, when a node agent runs it.
        on_order: called on the relay's thread with each order for the agent.
        tls: reach the controller over mutual TLS with these (the local
            ranks still connect on loopback, with the job secret).
        batch_window_s, heartbeat_window_s: how long messages wait to travel
            together.
    """

    def __init__(self, controller: str, token: str, *, host: str = "127.0.0.1", port: int = 0,
                 node: str | None = None, max_message_bytes: int = 1 << 20, batch_window_s: float = 0.002,
                 heartbeat_window_s: float = 0.25, agent: pb.AgentHello | None = None,
                 on_order: Callable[[pb.AgentOrder], None] | None = None, tls: TLS | None = None) -> None:
        self.controller, self.token, self.tls = controller, token, tls
        self.host, self.port = host, port
        self.node = node or f"{socket.gethostname()}:{os.getpid()}"
        self.limit = max_message_bytes
        self.batch_window_s, self.heartbeat_window_s = batch_window_s, heartbeat_window_s
        self.address = ""
        self._local: dict[int, asyncio.Queue] = {}
        self._outgoing: list[pb.RankEnvelope] = []
        self._heartbeats: dict[int, pb.RankEnvelope] = {}
        self._flush_at: float | None = None
        self._flush_handle: asyncio.TimerHandle | None = None
        self._upstream_alive = False
        self._stopping = False
        self._agent, self._on_order = agent, on_order
        #: The ranks whose sessions are open now (replaced whole on each
        #: change, so another thread reads it without a lock).
        self.connected: frozenset[int] = frozenset()
        self.refusals = Refusals(log, f"relay {self.node}")
        # A rank's message travels inside an envelope inside a NodeMessage: it must leave room for both, or
        # the controller would refuse the batch and end the stream of every rank on this node.
        self._room = max_message_bytes - len(self.node.encode()) - 64

    # ------------------------------------------------------------ lifecycle
    thread_name = "trainguard-relay"

    def start(self) -> str:
        """Connect upstream, start serving local ranks, return ``host:port``.

        Raises:
            TrainguardError: the controller is unreachable or refused the relay.
        """
        self.address = f"{self.host}:{self._start_loop(timeout_s=60)}"
        log.info("relay %s for the ranks of this node listening on %s", self.node, self.address)
        return self.address

    async def _serve(self, ready: Future) -> None:
        options = [("grpc.max_send_message_length", self.limit), ("grpc.max_receive_message_length", 4 * self.limit)]
        self._channel = grpc.aio.secure_channel(self.controller, self.tls.channel(), options=options) \
            if self.tls is not None else grpc.aio.insecure_channel(self.controller, options=options)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout=30)
            metadata = await alogin(self._channel, self.token, self.controller, method_path("NodeSession"))
        except asyncio.TimeoutError:
            raise TrainguardError(f"relay cannot reach the controller at {self.controller}") from None
        except Impostor as e:
            raise TrainguardError(f"relay refused the controller at {self.controller}: {e}") from None
        except grpc.RpcError as e:
            raise TrainguardError(f"the controller at {self.controller} refused the relay: {e.code().name} "
                                  f"{e.details()}") from None
        self._upstream = self._channel.stream_stream(
            f"/{SERVICE}/NodeSession", request_serializer=pb.NodeMessage.SerializeToString,
            response_deserializer=pb.NodeCommands.FromString)(metadata=metadata)
        self._upstream_alive = True
        self._sends: asyncio.Queue = asyncio.Queue()
        if self._agent is not None:
            self._sends.put_nowait(pb.NodeMessage(node=self.node, agent=self._agent))
        self._tasks = [asyncio.ensure_future(self._read_upstream()), asyncio.ensure_future(self._write_upstream())]
        auth = ServerAuth(self.token, None, self.refusals, cap=1024)
        self._server = grpc.aio.server(
            interceptors=[Authenticate(auth, frozenset({"Session"}))],
            options=[("grpc.max_receive_message_length", 4 * self.limit), ("grpc.so_reuseport", 0),
                     ("grpc.http2.bdp_probe", 0)])  # as the controller's: see server.py
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Session": grpc.stream_stream_rpc_method_handler(
                self._session, request_deserializer=decoder(pb.RankMessage, self.limit),
                response_serializer=pb.ControllerMessage.SerializeToString), "Handshake": auth.handler()}),))
        port = self._server.add_insecure_port(f"{self.host}:{self.port}")
        auth.names = Names(self.host, port)
        await self._server.start()
        ready.set_result(port)
        self._done = asyncio.Event()
        await self._done.wait()

    async def _shutdown(self, grace_s: float) -> None:
        self._stopping = True
        await self._server.stop(grace_s)
        self._upstream.cancel()
        await self._channel.close()
        for task in self._tasks:
            task.cancel()
        self._done.set()

    # ------------------------------------------------------------ upstream
    async def _read_upstream(self) -> None:
        try:
            async for batch in self._upstream:
                for order in batch.orders:
                    if self._on_order is not None:
                        try:
                            self._on_order(order)
                        except Exception:  # the agent's bug must not end the node's stream
                            log.exception("relay %s: the agent failed to take order %d", self.node, order.id)
                for delivery in batch.items:
                    item = (_Refusal(grpc.StatusCode.INVALID_ARGUMENT, delivery.refused) if delivery.refused
                            else delivery.message)
                    for rank in delivery.ranks:
                        queue = self._local.get(rank)
                        if queue is not None:
                            queue.put_nowait(item)
        except grpc.RpcError as e:
            if not self._stopping:
                log.error("relay %s lost the controller: %s %s", self.node, e.code().name, e.details())
        finally:
            self._upstream_alive = False
            for queue in self._local.values():
                queue.put_nowait(_END)

    async def _write_upstream(self) -> None:
        while True:
            message = await self._sends.get()
            try:
                await self._upstream.write(message)
            except (grpc.RpcError, asyncio.InvalidStateError):
                return  # the reader reports the loss

    def report(self, event: pb.AgentEvent) -> None:
        """Send the agent's answer to an order (from any thread)."""
        self._loop.call_soon_threadsafe(self._sends.put_nowait, pb.NodeMessage(node=self.node, events=[event]))

    def report_process_exit(self, rank: int, pid: int, code: int, reason: str = "",
                            last_running: float = 0.0) -> None:
        """Tell the controller one of the agent's workers exited (from any
        thread): over this stream, the agent's own, so no one else can."""
        exit_ = pb.ProcessExit(rank=rank, pid=pid, exit_code=code, reason=reason, last_running=last_running)
        self._loop.call_soon_threadsafe(self._sends.put_nowait, pb.NodeMessage(node=self.node, exits=[exit_]))

    def _forward(self, rank: int, message: pb.RankMessage | None = None, *, disconnected: bool = False) -> None:
        envelope = pb.RankEnvelope(rank=rank, message=message, disconnected=disconnected)
        if message is not None and message.WhichOneof("body") == "heartbeat":
            self._heartbeats[rank] = envelope
            self._schedule(self.heartbeat_window_s)
        else:
            self._heartbeats.pop(rank, None)
            self._outgoing.append(envelope)
            self._schedule(self.batch_window_s)

    def _schedule(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        if self._flush_handle is not None and self._flush_at <= when:
            return
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush_at, self._flush_handle = when, loop.call_at(when, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        items, self._outgoing = self._outgoing + list(self._heartbeats.values()), []
        self._heartbeats = {}
        batch, size = [], 0
        for item in items:  # keep each message well under the size limit
            if batch and size + item.ByteSize() > self.limit // 2:
                self._sends.put_nowait(pb.NodeMessage(node=self.node, items=batch))
                batch, size = [], 0
            batch.append(item)
            size += item.ByteSize() + 8
        if batch:
            self._sends.put_nowait(pb.NodeMessage(node=self.node, items=batch))

    # ------------------------------------------------------------ local ranks
    def _too_big(self, message: pb.RankMessage) -> str:
        return (f"RankMessage of {message.ByteSize()} bytes does not fit this relay's {self._room}-byte room "
                f"(TRAINGUARD_MAX_MESSAGE_BYTES {self.limit}, less the envelope)")

    async def _refuse(self, context, code: grpc.StatusCode, reason: str) -> None:
        self.refusals(context.peer(), code, reason)
        await context.abort(code, f"trainguard: {reason}")

    async def _session(self, requests: AsyncIterator, context) -> AsyncIterator[pb.ControllerMessage]:
        stream = requests.__aiter__()
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            self.refusals(context.peer(), grpc.StatusCode.INVALID_ARGUMENT, empty_stream(4 * self.limit))
            return
        if isinstance(first, Refused):
            await self._refuse(context, first.code, first.reason)
        if first.ByteSize() > self._room:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, self._too_big(first))
        if first.WhichOneof("body") != "hello":
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message of a session must be "
                                                                          "Hello")
        rank = first.hello.rank
        if rank in self._local:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"rank {rank} is already connected to this node's relay")
        if not self._upstream_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "trainguard: the relay lost the controller")
        queue: asyncio.Queue = asyncio.Queue()
        self._local[rank] = queue
        self.connected = frozenset(self._local)
        self._forward(rank, first)
        state = {"goodbye": False}
        reader = asyncio.ensure_future(self._pump(rank, stream, queue, state))
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    break
                if isinstance(item, _Refusal):
                    await self._refuse(context, item.code, f"rank {rank}: {item.reason}")
                yield item
        finally:
            reader.cancel()
            if self._local.get(rank) is queue:
                del self._local[rank]
                self.connected = frozenset(self._local)
                if not state["goodbye"] and not self._stopping and self._upstream_alive:
                    self._forward(rank, disconnected=True)

    async def _pump(self, rank: int, stream, queue: asyncio.Queue, state: dict) -> None:
        try:
            async for message in stream:
                if isinstance(message, Refused):
                    queue.put_nowait(_Refusal(message.code, message.reason))
                    return
                if message.ByteSize() > self._room:
                    queue.put_nowait(_Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, self._too_big(message)))
                    return
                self._forward(rank, message)
                if message.WhichOneof("body") == "goodbye":
                    state["goodbye"] = True
                    break
        except asyncio.CancelledError:
            raise
        except grpc.RpcError:
            pass  # the rank's process went away: the session's finally clause reports it
        queue.put_nowait(_END)
