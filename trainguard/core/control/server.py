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
from typing import Any

import grpc

from ..api import ControllerState, TrainguardError
from ..loop import LoopThread
from ..config import ControllerConfig
from .controller import ControllerCore
from .heap import Heap
from ..profiling.live import LiveDetector
from ..protocol import trainguard_pb2 as pb
from ..handshake import Authenticate
from ..proof import Names
from ..rpc import SERVICE, decoder
from ..secret import TLS, new_token
from .service import Service

__all__ = ["Controller"]

log = logging.getLogger("trainguard.controller")

_TICK_S = 0.05

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
        self._service: Service | None = None
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
        self._service = Service(self._core, self.token)
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
