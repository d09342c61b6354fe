"""The simulated ranks of ``bench/scale.py``, in its client processes: each
rank a gRPC bidi ``Session`` to the controller (:class:`Ranks`), or ranks
behind simulated node relays sharing one ``NodeSession`` per node
(:class:`Nodes`); they say Hello, heartbeat, answer commands as the real
processor does, stamp the first arrival of each command kind, and report
one fault on request. :func:`client_main` is a client process's entry
point, driven over a pipe by the benchmark."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import resource
import time

import grpc

from trainguard.core.rank.messages import replica_group
from trainguard.core.replicas import ReplicaGroup
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.handshake import alogin
from trainguard.core.rpc import SERVICE
from trainguard.core.secret import TLS

STEP = 100
KINDS = ("stop", "clean", "resume")  # commands whose first arrival per rank is kept
RETRYING = 128  # refused sessions trying again at once, per client process


def raise_nofile() -> None:
    """Raise this process's open-file soft limit to the hard limit (a socket per stream)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)


# ---------------------------------------------------------------- clients
def _channel(address: str, opts: list) -> grpc.aio.Channel:
    """A client channel, over mutual TLS when the run sets TRAINGUARD_TLS_* (see scale.py's make_pki)."""
    tls = TLS.from_env()
    return grpc.aio.secure_channel(address, tls.channel(), options=opts) if tls is not None else \
        grpc.aio.insecure_channel(address, options=opts)


class Ranks:
    """The simulated ranks of one client process, on one asyncio loop."""

    def __init__(self, ranks, world, address, token, interval, per_channel):
        self.ranks, self.world, self.interval = ranks, world, interval
        self.address, self.token = address, token  # each session opens with the handshake (core.handshake)
        opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
        self.channels = [_channel(address, opts) for _ in range(-(-len(ranks) // per_channel))]
        self.status = {run: pb.Status(step=STEP, run=run, data=pb.UPDATED) for run in (pb.TRAINING, pb.STOPPED)}
        self.heartbeat = {run: pb.RankMessage(heartbeat=s).SerializeToString() for run, s in self.status.items()}
        self.stopped_msg = pb.RankMessage(stopped=self.status[pb.STOPPED]).SerializeToString()
        # An embedded message's fields that appear twice are merged: the big
        # replica group is serialized once and appended to each rank's Hello.
        self.group = pb.RankMessage(hello=pb.Hello(replicas=[replica_group(ReplicaGroup.full(range(world)))]
                                                   )).SerializeToString()
        n = len(ranks)
        self.welcome, self.run, self.calls = [0.0] * n, [pb.TRAINING] * n, [None] * n
        self.first = {k: [0.0] * n for k in KINDS}
        self.locks = [asyncio.Lock() for _ in range(n)]  # one write at a time per stream
        self.retrying = asyncio.Semaphore(RETRYING)
        self.sent = self.refused = self.refused_first = 0
        self.errors: list[str] = []

    def tasks(self):
        return [self.rank(i) for i in range(len(self.ranks))]

    async def write(self, i: int, data: bytes) -> None:
        async with self.locks[i]:
            await self.calls[i].write(data)

    async def connect(self, i: int):
        first = True
        path, call = f"/{SERVICE}/Session", None
        while True:
            channel = self.channels[i % len(self.channels)]
            try:
                async with (contextlib.nullcontext() if first else self.retrying):
                    md = await alogin(channel, self.token, self.address, path, timeout_s=120)
                    call = self.calls[i] = channel.stream_stream(path)(metadata=md)
                    await call.write(pb.RankMessage(hello=pb.Hello(
                        rank=self.ranks[i], world_size=self.world, pid=os.getpid(), host="sim", device="sim",
                        device_repairable=True, status=self.status[pb.TRAINING])).SerializeToString() + self.group)
                    await call.read()  # Welcome
                self.welcome[i] = time.time()
                return call
            except (grpc.RpcError, asyncio.InvalidStateError) as e:
                # refused: CANCELLED, or INTERNAL when the write raced the cancel (the handshake's or the session's)
                code = e.code() if isinstance(e, grpc.RpcError) and call is None else await call.code()
                if code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL):
                    raise
                call = None
                self.refused += 1
                self.refused_first += first
                first = False
                await asyncio.sleep(random.uniform(0.5, 2.0))

    async def rank(self, i: int) -> None:
        try:
            call = await self.connect(i)
            reader = asyncio.ensure_future(self.read(i, call))
            loop = asyncio.get_running_loop()
            due = loop.time() + random.uniform(0, self.interval)
            while not reader.done():
                await asyncio.sleep(max(0.0, due - loop.time()))
                due += self.interval
                await self.write(i, self.heartbeat[self.run[i]])
                self.sent += 1
        except (grpc.RpcError, asyncio.InvalidStateError) as e:
            if len(self.errors) < 5:
                self.errors.append(f"rank {self.ranks[i]}: {e!r}"[:300])

    async def read(self, i: int, call) -> None:
        try:
            while (data := await call.read()) is not grpc.aio.EOF:
                now = time.time()
                cmd = pb.ControllerMessage.FromString(data).command
                action = cmd.WhichOneof("action")
                if action in self.first and not self.first[action][i]:
                    self.first[action][i] = now
                if action == "stop":
                    self.run[i] = pb.STOPPED
                    await self.write(i, self.stopped_msg)
                elif action == "resume":
                    self.run[i] = pb.TRAINING
                elif action != "exit":
                    await self.write(i, pb.RankMessage(result=pb.CommandResult(
                        command_id=cmd.id, ok=True, status=self.status[pb.STOPPED])).SerializeToString())
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the controller went away (end of the run)

    async def fault(self, rank: int) -> float:
        i = self.ranks.index(rank)
        self.run[i] = pb.STOPPED
        t = time.time()
        await self.write(i, pb.RankMessage(fault=pb.FaultReport(
            kind=pb.UCE, severity=pb.HIGH, phase="optimizer", message="simulated UCE", occurred_at=t,
            status=self.status[pb.STOPPED])).SerializeToString())
        return t

    def report(self, times: bool = False) -> dict:
        welcomed = [t for t in self.welcome if t]
        out = {"welcomed": len(welcomed), "last_welcome": max(welcomed, default=0.0), "sent": self.sent,
               "refused": self.refused, "refused_first": self.refused_first, "errors": self.errors,
               **{k: sum(map(bool, v)) for k, v in self.first.items()}}
        if times:
            out["times"] = {k: [t for t in v if t] for k, v in self.first.items()}
        return out


class Nodes:
    """Simulated node relays: each carries ``per_node`` ranks over one
    ``NodeSession``, batching their messages as ``trainguard.core.relay``
    does (what the controller sees is exactly a relay's traffic)."""

    def __init__(self, ranks, world, address, token, interval, per_channel, per_node):
        self.ranks, self.world, self.interval = ranks, world, interval
        self.address, self.token = address, token  # each node's stream opens with the handshake (core.handshake)
        self.nodes = [ranks[j:j + per_node] for j in range(0, len(ranks), per_node)]
        self.index = {r: i for i, r in enumerate(ranks)}
        opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
        self.channels = [_channel(address, opts)
                         for _ in range(-(-len(self.nodes) // per_channel))]
        self.status = {run: pb.Status(step=STEP, run=run, data=pb.UPDATED) for run in (pb.TRAINING, pb.STOPPED)}
        self.group = replica_group(ReplicaGroup.full(range(world)))
        n = len(ranks)
        self.welcome, self.run = [0.0] * n, [pb.TRAINING] * n
        self.first = {k: [0.0] * n for k in KINDS}
        self.calls = [None] * len(self.nodes)
        self.locks = [asyncio.Lock() for _ in self.nodes]
        self.sent = self.refused = self.refused_first = 0
        self.errors: list[str] = []

    def tasks(self):
        return [self.node(j) for j in range(len(self.nodes))]

    async def write(self, j: int, items) -> None:
        async with self.locks[j]:
            await self.calls[j].write(pb.NodeMessage(node=f"sim{j}", items=items))

    def envelope(self, rank: int, **body) -> pb.RankEnvelope:
        return pb.RankEnvelope(rank=rank, message=pb.RankMessage(**body))

    async def node(self, j: int) -> None:
        ranks = self.nodes[j]
        try:
            channel, path = self.channels[j % len(self.channels)], f"/{SERVICE}/NodeSession"
            md = await alogin(channel, self.token, self.address, path, timeout_s=120)
            self.calls[j] = channel.stream_stream(
                path, request_serializer=pb.NodeMessage.SerializeToString,
                response_deserializer=pb.NodeCommands.FromString)(metadata=md)
            await self.write(j, [self.envelope(r, hello=pb.Hello(
                rank=r, world_size=self.world, pid=os.getpid(), host="sim", device="sim", device_repairable=True,
                status=self.status[pb.TRAINING], replicas=[self.group])) for r in ranks])
            reader = asyncio.ensure_future(self.read(j))
            loop = asyncio.get_running_loop()
            due = loop.time() + random.uniform(0, self.interval)
            while not reader.done():
                await asyncio.sleep(max(0.0, due - loop.time()))
                due += self.interval
                await self.write(j, [self.envelope(r, heartbeat=self.status[self.run[self.index[r]]])
                                     for r in ranks])
                self.sent += len(ranks)
        except (grpc.RpcError, asyncio.InvalidStateError) as e:
            if len(self.errors) < 5:
                self.errors.append(f"node {j}: {e!r}"[:300])

    async def read(self, j: int) -> None:
        try:
            while (batch := await self.calls[j].read()) is not grpc.aio.EOF:
                now, replies = time.time(), []
                for d in batch.items:
                    msg = d.message
                    if msg.HasField("welcome"):
                        for r in d.ranks:
                            self.welcome[self.index[r]] = now
                        continue
                    cmd = msg.command
                    action = cmd.WhichOneof("action")
                    for r in d.ranks:
                        i = self.index[r]
                        if action in self.first and not self.first[action][i]:
                            self.first[action][i] = now
                        if action == "stop":
                            self.run[i] = pb.STOPPED
                            replies.append(self.envelope(r, stopped=self.status[pb.STOPPED]))
                        elif action == "resume":
                            self.run[i] = pb.TRAINING
                        elif action != "exit":
                            replies.append(self.envelope(r, result=pb.CommandResult(
                                command_id=cmd.id, ok=True, status=self.status[pb.STOPPED])))
                if replies:
                    await self.write(j, replies)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the controller went away (end of the run)

    async def fault(self, rank: int) -> float:
        i, j = self.index[rank], next(j for j, ranks in enumerate(self.nodes) if rank in ranks)
        self.run[i] = pb.STOPPED
        t = time.time()
        await self.write(j, [self.envelope(rank, fault=pb.FaultReport(
            kind=pb.UCE, severity=pb.HIGH, phase="optimizer", message="simulated UCE", occurred_at=t,
            status=self.status[pb.STOPPED]))])
        return t

    report = Ranks.report


async def _client(conn, args) -> None:
    *common_args, per_node = args
    sim = Nodes(*common_args, per_node) if per_node > 1 else Ranks(*common_args)
    requests: asyncio.Queue = asyncio.Queue()
    asyncio.get_running_loop().add_reader(conn.fileno(), lambda: requests.put_nowait(conn.recv()))
    conn.send("ready")
    tasks = []
    while True:
        req = await requests.get()
        if req == "go":
            tasks = [asyncio.ensure_future(t) for t in sim.tasks()]
            conn.send(time.time())
        elif req in ("report", "times"):
            conn.send(sim.report(times=req == "times"))
        elif isinstance(req, tuple):  # ("fault", rank)
            conn.send(await sim.fault(req[1]))
        elif req == "stop":
            for t in tasks:
                t.cancel()
            await asyncio.gather(*(ch.close(grace=None) for ch in sim.channels), return_exceptions=True)
            conn.send(None)
            return


def client_main(conn, *args) -> None:
    raise_nofile()
    asyncio.run(_client(conn, args))
