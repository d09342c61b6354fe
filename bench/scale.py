"""Controller scale: one controller, thousands of simulated ranks.

For 1024, 4096 and 16384 ranks (``--quick``: 256) it measures

* ``register_s``: every rank opens its session at once, as when a job
  starts; seconds until the last one got its Welcome. ``refused_first``
  counts ranks whose first try the controller cancelled (gRPC's server
  cancels calls past its pending-request limit); they try again after a
  random pause, at most ``RETRYING`` at a time per client process. A real
  processor does not retry: for it each of these is a failed start;
* ``controller_cpu_pct``: CPU of the controller process (all threads,
  ``/proc/<pid>/stat``) while every rank heartbeats at the default interval
  (``ControllerConfig().heartbeat_interval_for(N)``: 1 s, stretched to N/4096 s
  above 4096 ranks), in % of one core, and
  ``state_after_steady``: NORMAL unless the controller fell behind and
  declared ranks hung;
* one fault: rank N/2 reports a UCE (severity HIGH). The controller stops
  every other rank, collects their ``stopped``, decides (a retry: all ranks
  share one full replica group) and sends the plan. From the moment the
  fault was written: ``fault_to_all_stop_s`` (the N-1 others received
  ``stop``), ``fault_to_all_plan_s`` (every rank received its first plan
  command, ``clean``), ``fault_to_resume_s`` (every rank received
  ``resume``: recovery over).

How: the controller (``trainguard.core.control.server.Controller``, unchanged) runs
in its own process. Ranks are asyncio coroutines in ``--clients`` client
processes (``bench/_scale_clients.py``), each rank one gRPC bidi stream;
the streams of a process share channels (``--streams-per-channel``, one TCP
connection each). A rank (or a simulated relay) first makes the handshake of
``trainguard.core.handshake`` (one unary call: the controller proves the
secret, the client gets a proof good for its one session; since issue 41),
then sends
Hello (its rank, the world size, the full replica group in the compact range
form the real processor sends, step 100 TRAINING UPDATED, device
repairable), heartbeats every interval from a random offset,
answers ``stop`` with ``stopped`` and other commands but ``resume`` and
``exit`` with an ok ``result``, like the real processor. Constant messages
are serialized once. Every process raises its open-file soft limit to the
hard limit. Times are ``time.time()`` stamps where a message was written or
read, on one machine; the clients compete with the controller for the cores
(their CPU is reported) and so does whatever else runs (``loadavg_1m``).

"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

try:
    from bench import common
except ImportError:  # run as `python bench/scale.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import common

from bench._scale_clients import KINDS, RETRYING, client_main, raise_nofile
from trainguard.core.config import ControllerConfig
from trainguard.core.rpc import new_token
from trainguard.core.secret import TLS

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


# ------------------------------------------------------------- controller
def controller_main(world: int, token: str, conn) -> None:
    from trainguard.core.control.server import Controller

    raise_nofile()
    ctl = Controller(ControllerConfig(), world, token=token, tls=TLS.from_env())  # TLS: see make_pki
    conn.send(ctl.start())
    while (req := conn.recv()) != "stop":
        try:
            if req == "state":
                conn.send(ctl.state.name)
                continue
            snap = ctl.snapshot()
            last = snap["recoveries"][-1] if snap["recoveries"] else {}
            conn.send({"state": snap["state"], "strategy": last.get("strategy"),
                       "recover_s": last.get("recover_s"), "reason": last.get("reason", "")[:400]})
        except Exception as e:  # a controller stuck in a long call does not answer within 30 s
            conn.send(f"unresponsive ({type(e).__name__})" if req == "state" else {"state": "unresponsive"})
    # The shutdown reads as every rank lost, and gRPC prints a traceback for
    # each session it cancels: not part of the measurement.
    logging.getLogger("trainguard").setLevel(logging.CRITICAL)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    ctl.stop(grace_s=0.5)
    conn.send(None)


def make_pki(d: Path) -> dict:
    """A certificate authority and one node certificate for 127.0.0.1 it
    signed (openssl), as TRAINGUARD_TLS_* settings: the controller and every
    client process use the same, as nodes given one Secret would."""
    import subprocess

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=bench ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    ssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "node.pem",
        "-days", "1", "-extfile", "ext.cnf")
    return {"TRAINGUARD_TLS_CERT": str(d / "node.pem"), "TRAINGUARD_TLS_KEY": str(d / "node.key"),
            "TRAINGUARD_TLS_CA": str(d / "ca.pem")}


# ----------------------------------------------------------------- driver
def ask(conns, req, timeout=60.0) -> list:
    for c in conns:
        c.send(req)
    if not all(c.poll(timeout) for c in conns):
        raise TimeoutError(f"no answer to {req!r} within {timeout} s")
    return [c.recv() for c in conns]


def run_size(n: int, a) -> dict:
    ctx = mp.get_context("spawn")
    token, interval = new_token(), ControllerConfig().heartbeat_interval_for(n)
    ctl_conn, child = ctx.Pipe()
    ctl = ctx.Process(target=controller_main, args=(n, token, child), daemon=True)
    ctl.start()
    address = ctl_conn.recv()
    # Whole nodes per client process: node k holds ranks k*per_node ... (k+1)*per_node - 1.
    per_node = a.ranks_per_node
    node_ranks = [list(range(k, min(k + per_node, n))) for k in range(0, n, per_node)]
    chunks = [[r for node in node_ranks[j::a.clients] for r in node] for j in range(min(a.clients, len(node_ranks)))]
    conns, procs = [], []
    for chunk in chunks:
        conn, child = ctx.Pipe()
        procs.append(ctx.Process(target=client_main, daemon=True,
                                 args=(child, chunk, n, address, token, interval, a.streams_per_channel,
                                       per_node)))
        procs[-1].start()
        conns.append(conn)
    row: dict = {"ranks": n, "tls": TLS.from_env() is not None, "ranks_per_node": per_node,
                 "heartbeat_interval_s": interval,
                 "loadavg_1m": round(os.getloadavg()[0], 1)}
    clients_cpu = lambda: sum(cpu_s(p.pid) for p in procs)  # noqa: E731
    try:
        for c in conns:
            c.recv()  # "ready": imported, channels made
        t_go = min(ask(conns, "go"))
        while True:
            reports = ask(conns, "report")
            registered = sum(r["welcomed"] for r in reports)
            if registered == n or time.time() > t_go + a.register_timeout:
                break
            time.sleep(0.5)
        row.update(registered=registered, refused=sum(r["refused"] for r in reports),
                   refused_first=sum(r["refused_first"] for r in reports),
                   errors=[e for r in reports for e in r["errors"]][:3])
        if registered < n:
            row["register_s"] = None
            print(f"  {n}: only {registered} ranks registered within {a.register_timeout:g} s", file=sys.stderr)
            return row
        row["register_s"] = round(max(r["last_welcome"] for r in reports) - t_go, 3)
        print(f"  {n}: registered in {row['register_s']} s", file=sys.stderr)

        time.sleep(2 * interval + 1)  # every rank is past its random first offset
        c0, k0, s0, t0 = cpu_s(ctl.pid), clients_cpu(), sum(r["sent"] for r in ask(conns, "report")), time.time()
        time.sleep(a.steady_s)
        c1, k1, s1, t1 = cpu_s(ctl.pid), clients_cpu(), sum(r["sent"] for r in ask(conns, "report")), time.time()
        row.update(controller_cpu_pct=round(100 * (c1 - c0) / (t1 - t0), 1),
                   clients_cpu_pct=round(100 * (k1 - k0) / (t1 - t0), 1),
                   heartbeats_per_s=round((s1 - s0) / (t1 - t0)), state_after_steady=ask([ctl_conn], "state")[0])
        print(f"  {n}: steady: controller {row['controller_cpu_pct']}% of a core at {row['heartbeats_per_s']} "
              f"heartbeats/s, {row['state_after_steady']}", file=sys.stderr)

        faulty = n // 2
        c0, k0 = cpu_s(ctl.pid), clients_cpu()
        owner = next(j for j, chunk in enumerate(chunks) if faulty in chunk)
        t_fault = ask([conns[owner]], ("fault", faulty))[0]
        state = "ABNORMAL"
        while time.time() < t_fault + a.episode_timeout and state != "EXITED" and not state.startswith("unresp"):
            if sum(r["resume"] for r in ask(conns, "report")) == n:
                break
            time.sleep(0.2)
            state = ask([ctl_conn], "state")[0]
        t_end = time.time()
        row.update(controller_cpu_pct_episode=round(100 * (cpu_s(ctl.pid) - c0) / (t_end - t_fault), 1),
                   clients_cpu_pct_episode=round(100 * (clients_cpu() - k0) / (t_end - t_fault), 1))
        times = {k: sorted(t for r in ask(conns, "times") for t in r["times"][k]) for k in KINDS}
        # the faulty rank gets no stop; stops after a failed plan come after the first n - 1
        for kind, col, need in (("stop", "fault_to_all_stop_s", n - 1), ("clean", "fault_to_all_plan_s", n),
                                ("resume", "fault_to_resume_s", n)):
            row[col] = round(times[kind][need - 1] - t_fault, 3) if len(times[kind]) >= need else None
        status = ask([ctl_conn], "status")[0]
        row.update(state_after_episode=status["state"], strategy=status.get("strategy"),
                   controller_recover_s=status.get("recover_s"), reason=status.get("reason"))
        print(f"  {n}: fault -> all stop {row['fault_to_all_stop_s']} s, plan {row['fault_to_all_plan_s']} s, "
              f"resume {row['fault_to_resume_s']} s ({row['strategy']}, {row['state_after_episode']})", file=sys.stderr)
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


COLUMNS = ["ranks", "tls", "ranks_per_node", "heartbeat_interval_s", "registered", "refused_first", "register_s", "controller_cpu_pct", "clients_cpu_pct",
           "state_after_steady", "fault_to_all_stop_s", "fault_to_all_plan_s", "fault_to_resume_s",
           "controller_cpu_pct_episode", "strategy", "state_after_episode", "loadavg_1m"]


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", help="rank counts (default 1024 4096 16384; quick 256)")
    p.add_argument("--clients", type=int, default=2, help="client processes holding the simulated ranks")
    p.add_argument("--streams-per-channel", type=int, default=64)
    p.add_argument("--ranks-per-node", type=int, default=8,
                   help="ranks behind each node relay (1: every rank holds its own session)")
    p.add_argument("--register-timeout", type=float, help="seconds (default 30 quick, 180 full)")
    p.add_argument("--steady-s", type=float, help="CPU window in seconds (default 3 quick, 10 full)")
    p.add_argument("--episode-timeout", type=float, default=120.0)
    p.add_argument("--tls", choices=("off", "on", "both"), default="both",
                   help="the control plane over mutual TLS, plain, or each size both ways side by side (default)")
    a = p.parse_args()
    sizes = a.sizes or ([256] if a.quick else [1024, 4096, 16384])
    a.register_timeout = a.register_timeout or (30.0 if a.quick else 180.0)
    a.steady_s = a.steady_s or (3.0 if a.quick else 10.0)
    raise_nofile()
    import tempfile

    modes = {"off": [False], "on": [True], "both": [False, True]}[a.tls]
    rows = []
    with tempfile.TemporaryDirectory(prefix="tg-bench-pki-") as d:
        pki = make_pki(Path(d)) if True in modes else {}
        for n in sizes:
            for tls in modes:  # the same size plain and over TLS, one after the other
                for k, v in pki.items():
                    os.environ.pop(k, None) if not tls else os.environ.__setitem__(k, v)
                rows.append(run_size(n, a))
        for k in pki:
            os.environ.pop(k, None)
    top = next(r for r in reversed(rows) if r["tls"] == modes[0])  # the goals: the plain run (or TLS alone)
    # the ranks registered; none when the controller did not stay NORMAL while they heartbeat
    serves = top["registered"] if top["registered"] < top["ranks"] or top.get("state_after_steady") == "NORMAL" else 0
    goals = [
        common.Goal(f"plan delivered to {top['ranks']} ranks after one fault", top.get("fault_to_all_plan_s"), 2.0, "s"),
        common.Goal(f"controller serves {top['ranks']} heartbeating ranks", serves, top["ranks"], "ranks",
                    higher_is_better=True),
    ]
    settings = {k: getattr(a, k) for k in ("clients", "streams_per_channel", "ranks_per_node", "register_timeout",
                                           "steady_s", "episode_timeout")}
    common.report("scale", rows, COLUMNS, goals, quick=a.quick, out=a.out,
                  extra={"settings": {**settings, "retrying_per_client": RETRYING}})


if __name__ == "__main__":
    main()
