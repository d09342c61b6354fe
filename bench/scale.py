"""Controller scale: one controller, thousands of simulated ranks.

What it measures, for 1024, 4096 and 16384 ranks (``--quick``: 256):

* ``register_s`` -- from the moment every simulated rank opens its session
  (all at once, as when a job starts) until the last one got its Welcome;
* ``controller_cpu_pct`` -- CPU of the controller process (all its threads,
  from ``/proc/<pid>/stat``) over a steady window of pure heartbeating at
  the default interval (``ControllerConfig().heartbeat_interval_s``, 1 s),
  in % of one core; ``state_after_steady`` says whether it stayed NORMAL
  (a controller that falls behind declares ranks hung);
* one fault: a rank reports a UCE (severity HIGH); the controller stops every
  other rank, collects their ``stopped`` answers, decides (a retry: every
  rank is in one full replica group) and sends the plan. Reported from the
  moment the fault was written: ``fault_to_all_stop_s`` (every other rank
  received ``stop``), ``fault_to_all_plan_s`` (every rank received its first
  plan command, ``clean``) and ``fault_to_resume_s`` (every rank received
  ``resume``: the recovery is over).

How: the controller (``trainguard.core.server.Controller``, unchanged) runs
in its own process. The ranks are not processors but asyncio coroutines in
``--clients`` client processes; each rank owns one gRPC bidi stream, and the
streams of a process share channels (``--streams-per-channel``; each channel
is its own TCP connection). A rank sends Hello (world size, pid, the full
replica group, step 100 TRAINING UPDATED), then a heartbeat every interval
from a random offset, answers ``stop`` with ``stopped`` and every other
command but ``resume`` and ``exit`` with an ok ``result``, as the real
processor does. Messages are serialized once where they never change.
Every process raises its open-file soft limit to the hard limit.
All processes share one machine, so times are ``time.time()`` stamps taken
where a message was written or read; the client processes compete with the
controller for the cores, and their CPU is reported beside it.

``--emulate-registration-fix`` is a what-if, never the default: inside the
controller process it replaces ``validate_layout`` by a no-op and interns
equal replica groups, to show the numbers once registration stops costing
O(N^2) and more (see the results' ``note``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import random
import resource
import sys
import time
from pathlib import Path

try:
    from bench import common
except ImportError:  # run as `python bench/scale.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import common

import grpc

from trainguard.core.config import ControllerConfig
from trainguard.core.protocol import trainguard_pb2 as pb
from trainguard.core.rpc import SERVICE, auth_metadata, new_token

STEP = 100
KINDS = ("stop", "clean", "resume")  # commands whose arrival times are kept
TICKS = os.sysconf("SC_CLK_TCK")


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


# ------------------------------------------------------------- controller
def _emulate_registration_fix() -> None:
    from trainguard.core import controller

    real, interned = controller.ReplicaGroup, {}

    def group(rank_list, replica_cnt, replica_shift=0):
        key = (rank_list, replica_cnt, replica_shift)
        return interned.setdefault(key, real(rank_list, replica_cnt, replica_shift))

    group.full = real.full
    controller.ReplicaGroup = group
    controller.validate_layout = lambda layout, world_size: None


def controller_main(world: int, token: str, conn, emulate_fix: bool) -> None:
    from trainguard.core.server import Controller

    raise_nofile()
    if emulate_fix:
        _emulate_registration_fix()
    ctl = Controller(ControllerConfig(), world, token=token)
    conn.send(ctl.start())
    while (req := conn.recv()) != "stop":
        try:
            snap = ctl.snapshot()
            last = snap["recoveries"][-1] if snap["recoveries"] else {}
            conn.send({"state": snap["state"], "strategy": last.get("strategy"), "recover_s": last.get("recover_s")})
        except Exception as e:  # a controller stuck in a long call does not answer within 30 s
            conn.send({"state": f"unresponsive ({type(e).__name__})"})
    logging.getLogger("trainguard").setLevel(logging.CRITICAL)  # the stop reads as every rank lost
    ctl.stop(grace_s=0.5)
    conn.send(None)


# ---------------------------------------------------------------- clients
class Ranks:
    """The simulated ranks of one client process, on one asyncio loop."""

    def __init__(self, ranks, world, address, token, interval, per_channel):
        self.ranks, self.world, self.interval = ranks, world, interval
        self.md = auth_metadata(token)
        n_ch = max(1, -(-len(ranks) // per_channel))
        opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 64 << 20)]
        self.channels = [grpc.aio.insecure_channel(address, options=opts) for _ in range(n_ch)]
        status = {run: pb.Status(step=STEP, run=run, data=pb.UPDATED) for run in (pb.TRAINING, pb.STOPPED)}
        self.status = status
        self.heartbeat = {run: pb.RankMessage(heartbeat=s).SerializeToString() for run, s in status.items()}
        self.stopped_msg = pb.RankMessage(stopped=status[pb.STOPPED]).SerializeToString()
        # Fields of an embedded message that appear twice are merged: the big
        # replica group is serialized once and appended to each rank's Hello.
        self.group = pb.RankMessage(hello=pb.Hello(replicas=[pb.ReplicaGroup(
            rank_list=range(world), replica_cnt=world)])).SerializeToString()
        n = len(ranks)
        self.welcome = [0.0] * n
        self.first = {k: [0.0] * n for k in KINDS}
        self.run = [pb.TRAINING] * n
        self.calls: list = [None] * n
        self.locks = [asyncio.Lock() for _ in range(n)]
        self.sent = 0
        self.refused = 0  # sessions the controller cancelled before Welcome
        self.errors: list[str] = []

    def hello(self, rank: int) -> bytes:
        return pb.RankMessage(hello=pb.Hello(
            rank=rank, world_size=self.world, pid=os.getpid(), host="sim", device="sim",
            device_repairable=True, status=self.status[pb.TRAINING])).SerializeToString() + self.group

    async def write(self, i: int, data: bytes) -> None:
        async with self.locks[i]:
            await self.calls[i].write(data)

    async def session(self, i: int):
        """Open rank ``i``'s session and wait for Welcome, again after a
        random pause while the controller refuses it (see ``refused``)."""
        while True:
            session = self.channels[i % len(self.channels)].stream_stream(f"/{SERVICE}/Session")
            call = self.calls[i] = session(metadata=self.md)
            try:
                await call.write(self.hello(self.ranks[i]))
                await call.read()  # Welcome
                self.welcome[i] = time.time()
                return call
            except (grpc.RpcError, asyncio.InvalidStateError):
                if await call.code() is not grpc.StatusCode.CANCELLED:
                    raise
                self.refused += 1
                await asyncio.sleep(random.uniform(0.5, 2.0))

    async def rank(self, i: int) -> None:
        try:
            call = await self.session(i)
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
            await self._read(i, call)
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the controller went away (end of the run)

    async def _read(self, i: int, call) -> None:
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

    async def fault(self, rank: int) -> float:
        i = self.ranks.index(rank)
        self.run[i] = pb.STOPPED
        t = time.time()
        await self.write(i, pb.RankMessage(fault=pb.FaultReport(
            kind=pb.UCE, severity=pb.HIGH, phase="optimizer", message="simulated UCE", occurred_at=t,
            status=self.status[pb.STOPPED])).SerializeToString())
        return t

    def report(self) -> dict:
        got = {k: [t for t in v if t] for k, v in self.first.items()}
        welcomed = [t for t in self.welcome if t]
        return {"welcomed": len(welcomed), "last_welcome": max(welcomed, default=0.0), "sent": self.sent, "refused": self.refused,
                "errors": self.errors, "cpu_s": cpu_s(os.getpid()),
                **{f"n_{k}": len(v) for k, v in got.items()}, **{f"last_{k}": max(v, default=0.0) for k, v in got.items()}}


async def _client(conn, args) -> None:
    sim = Ranks(*args)
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: requests.put_nowait(conn.recv()))
    conn.send("ready")
    tasks = []
    while True:
        req = await requests.get()
        if req == "go":
            tasks = [asyncio.ensure_future(sim.rank(i)) for i in range(len(sim.ranks))]
            conn.send(time.time())
        elif req == "report":
            conn.send(sim.report())
        elif isinstance(req, tuple) and req[0] == "fault":
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


# ----------------------------------------------------------------- driver
def ask(conns, req, timeout=60.0):
    for c in conns:
        c.send(req)
    out = []
    for c in conns:
        if not c.poll(timeout):
            raise TimeoutError(f"no answer to {req!r} within {timeout} s")
        out.append(c.recv())
    return out


def wait_for(conns, pred, timeout: float, every: float = 0.25):
    """Poll the clients until ``pred(reports)`` or ``timeout``; the last reports."""
    deadline = time.time() + timeout
    while True:
        reports = ask(conns, "report")
        if pred(reports) or time.time() > deadline:
            return reports
        time.sleep(every)


def run_size(n: int, a) -> dict:
    ctx = mp.get_context("spawn")
    token, interval = new_token(), ControllerConfig().heartbeat_interval_s
    ctl_conn, child = ctx.Pipe()
    ctl = ctx.Process(target=controller_main, args=(n, token, child, a.emulate_registration_fix), daemon=True)
    ctl.start()
    address = ctl_conn.recv()
    k = min(a.clients, n)
    chunks = [list(range(n))[j::k] for j in range(k)]
    conns, procs = [], []
    for chunk in chunks:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=client_main, daemon=True,
                        args=(child, chunk, n, address, token, interval, a.streams_per_channel))
        p.start()
        conns.append(parent)
        procs.append(p)
    row: dict = {"ranks": n, "controller": "registration fix emulated" if a.emulate_registration_fix else "as is"}
    try:
        for c in conns:
            c.recv()  # "ready": imported, channels made
        t_go = min(ask(conns, "go"))
        reports = wait_for(conns, lambda rs: sum(r["welcomed"] for r in rs) == n, a.register_timeout, 1.0)
        registered = sum(r["welcomed"] for r in reports)
        row["registered"] = registered
        row["refused"] = sum(r["refused"] for r in reports)
        row["errors"] = [e for r in reports for e in r["errors"]][:3]
        if registered < n:
            row["register_s"] = None
            print(f"  {n}: only {registered} ranks registered within {a.register_timeout:g} s", file=sys.stderr)
            return row
        row["register_s"] = round(max(r["last_welcome"] for r in reports) - t_go, 3)
        print(f"  {n}: registered in {row['register_s']} s", file=sys.stderr)

        time.sleep(2 * interval + 1)  # every rank is past its random first offset
        c0, s0, t0 = cpu_s(ctl.pid), sum(r["sent"] for r in ask(conns, "report")), time.time()
        k0 = sum(cpu_s(p.pid) for p in procs)
        time.sleep(a.steady_s)
        c1, rs, t1 = cpu_s(ctl.pid), ask(conns, "report"), time.time()
        row["controller_cpu_pct"] = round(100 * (c1 - c0) / (t1 - t0), 1)
        row["clients_cpu_pct"] = round(100 * (sum(cpu_s(p.pid) for p in procs) - k0) / (t1 - t0), 1)
        row["heartbeats_per_s"] = round((sum(r["sent"] for r in rs) - s0) / (t1 - t0))
        row["state_after_steady"] = ask([ctl_conn], "status")[0]["state"]
        print(f"  {n}: steady window: controller {row['controller_cpu_pct']}% of a core, "
              f"{row['heartbeats_per_s']} heartbeats/s, {row['state_after_steady']}", file=sys.stderr)

        faulty = n // 2
        owner = next(j for j, chunk in enumerate(chunks) if faulty in chunk)
        c0, k0 = cpu_s(ctl.pid), sum(cpu_s(p.pid) for p in procs)
        t_fault = ask([conns[owner]], ("fault", faulty))[0]
        reports = wait_for(conns, lambda rs: sum(r["n_resume"] for r in rs) == n, a.episode_timeout, 0.1)
        t_end = time.time()
        row["controller_cpu_pct_episode"] = round(100 * (cpu_s(ctl.pid) - c0) / (t_end - t_fault), 1)
        row["clients_cpu_pct_episode"] = round(100 * (sum(cpu_s(p.pid) for p in procs) - k0) / (t_end - t_fault), 1)
        for kind, col, need in (("stop", "fault_to_all_stop_s", n - 1), ("clean", "fault_to_all_plan_s", n),
                                ("resume", "fault_to_resume_s", n)):
            got = sum(r[f"n_{kind}"] for r in reports)
            row[col] = round(max(r[f"last_{kind}"] for r in reports) - t_fault, 3) if got >= need else None
            row[f"got_{kind}"] = got
        status = ask([ctl_conn], "status")[0]
        row.update(state_after_episode=status["state"], strategy=status.get("strategy"),
                   controller_recover_s=status.get("recover_s"))
        print(f"  {n}: fault -> all stop {row['fault_to_all_stop_s']} s, plan {row['fault_to_all_plan_s']} s, "
              f"resume {row['fault_to_resume_s']} s ({row['strategy']})", file=sys.stderr)
        return row
    finally:
        for c in [ctl_conn] + conns:  # the controller first: it would take the clients' exits for faults
            try:
                ask([c], "stop", 20)
            except (TimeoutError, OSError, EOFError):
                pass
        for p in procs + [ctl]:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


COLUMNS = ["ranks", "registered", "register_s", "controller_cpu_pct", "clients_cpu_pct", "state_after_steady",
           "fault_to_all_stop_s", "fault_to_all_plan_s", "fault_to_resume_s", "controller_cpu_pct_episode",
           "strategy"]


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=None, help="rank counts (default 1024 4096 16384)")
    p.add_argument("--clients", type=int, default=2, help="client processes holding the simulated ranks")
    p.add_argument("--streams-per-channel", type=int, default=64)
    p.add_argument("--register-timeout", type=float, default=None, help="seconds (default 30 quick, 180 full)")
    p.add_argument("--steady-s", type=float, default=None, help="CPU window (default 3 quick, 10 full)")
    p.add_argument("--episode-timeout", type=float, default=120.0)
    p.add_argument("--emulate-registration-fix", action="store_true", help="what-if; see the module docstring")
    a = p.parse_args()
    sizes = a.sizes or ([256] if a.quick else [1024, 4096, 16384])
    a.register_timeout = a.register_timeout or (30.0 if a.quick else 180.0)
    a.steady_s = a.steady_s or (3.0 if a.quick else 10.0)
    raise_nofile()
    rows = [run_size(n, a) for n in sizes]
    top = rows[-1]
    serves = top["registered"] if top.get("state_after_steady") == "NORMAL" else 0
    goals = [
        common.Goal(f"plan delivered to {top['ranks']} ranks after one fault", top.get("fault_to_all_plan_s"), 2.0, "s"),
        common.Goal(f"controller serves {top['ranks']} heartbeating ranks", serves, top["ranks"], "ranks",
                    higher_is_better=True),
    ]
    out = a.out
    if a.emulate_registration_fix and out is None:
        out = common.RESULTS / f"scale{'-quick' if a.quick else ''}-registration-fix.json"
    common.report("scale", rows, COLUMNS, goals, quick=a.quick, out=out, extra={"settings": {
        "clients": a.clients, "streams_per_channel": a.streams_per_channel, "register_timeout_s": a.register_timeout,
        "steady_s": a.steady_s, "heartbeat_interval_s": ControllerConfig().heartbeat_interval_s,
        "emulate_registration_fix": a.emulate_registration_fix}})


if __name__ == "__main__":
    main()
