"""What unauthenticated calls cost the controller: memory, and the log.

A controller (``trainguard.core.control.server.Controller``, 1 MiB message limit)
runs in a process of its own; ``--calls`` concurrent calls without the job
secret, each with a ``--mib`` body, hit it at once -- half ``ReportProcessExit``
(unary), half ``Session`` (a stream) -- then a legitimate ``GetStatus``.
Measured from ``/proc/<pid>/status``: the controller's resident memory
before (``VmRSS``) and its peak (``VmHWM``), and how many log lines the
flood wrote. With ``--baseline TREE`` the same runs against another
checkout of trainguard (say, a worktree of the code before), side by side.

usage: python bench/preauth.py [--quick] [--baseline TREE] [--calls N] [--mib M]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    from bench import common
except ImportError:  # run as `python bench/preauth.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench import common

import grpc

ROOT = Path(__file__).resolve().parent.parent
SECRET = "bench-secret-" + "7" * 40
SERVE = """
import logging, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from trainguard.core import Controller, ControllerConfig
c = Controller(ControllerConfig(max_message_bytes=1 << 20), 8, token=sys.argv[1])
print(c.start(), flush=True)
time.sleep(3600)
"""


def _status(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) // 1024  # MiB
    return out


def _still_serves(address: str) -> None:
    """A call with the secret is answered after the flood (the tree's own way: a proof made after a handshake
    since issue 41, the bearer secret before)."""
    path = "/trainguard.v1.Control/GetStatus"
    with grpc.insecure_channel(address) as channel:
        try:
            from trainguard.core.handshake import login

            md = login(channel, SECRET, address, path)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            md = (("authorization", f"Bearer {SECRET}"),)
        channel.unary_unary(path)(b"", metadata=md, timeout=10)


def flood(tree: Path, calls: int, mib: float) -> dict:
    with tempfile.TemporaryFile("w+") as log:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.Popen([sys.executable, "-c", SERVE, SECRET], env=env, stdout=subprocess.PIPE,
                                stderr=log, text=True, cwd=tree)  # `-c` puts the working directory first
        try:
            address = proc.stdout.readline().strip()
            time.sleep(1.0)
            before = _status(proc.pid)
            body = b"\x0a" + b"\x01" * int(mib * (1 << 20))
            md = (("authorization", "Bearer wrong-" + "0" * 40),)
            codes: list[str] = []

            def one(i: int) -> None:
                channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
                try:
                    if i % 2:
                        channel.unary_unary("/trainguard.v1.Control/ReportProcessExit")(body, metadata=md, timeout=60)
                    else:
                        list(channel.stream_stream("/trainguard.v1.Control/Session")(iter([body]), metadata=md,
                                                                                      timeout=60))
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)
                finally:
                    channel.close()
            t0 = time.perf_counter()
            threads = [threading.Thread(target=one, args=(i,)) for i in range(calls)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            flood_s = time.perf_counter() - t0
            after = _status(proc.pid)
            _still_serves(address)
        finally:
            proc.kill()
            proc.wait()
        log.seek(0)
        lines = [x for x in log.read().splitlines() if "refused" in x]
    return {"rss_before_MiB": before["VmRSS"], "peak_MiB": after["VmHWM"], "grown_MiB": after["VmHWM"] - before["VmRSS"],
            "refused": sum(c == "UNAUTHENTICATED" for c in codes), "other_codes": sorted(set(codes) - {"UNAUTHENTICATED"}),
            "log_lines": len(lines), "flood_s": round(flood_s, 2)}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, help="another trainguard checkout, measured the same way beside")
    p.add_argument("--calls", type=int, help="concurrent unauthenticated calls (default 100; quick 20)")
    p.add_argument("--mib", type=float, default=4.0, help="each call's body in MiB (default 4)")
    a = p.parse_args()
    calls = a.calls or (20 if a.quick else 100)
    trees = [("this tree", ROOT)] + ([("baseline", a.baseline.resolve())] if a.baseline else [])
    rows = []
    for round_ in range(2):  # alternating, twice: the machine's noise shows
        for label, tree in trees:
            r = flood(tree, calls, a.mib)
            rows.append({"code": label, "round": round_ + 1, "calls": calls, "body_MiB": a.mib, **r})
            print(f"  {label} round {round_ + 1}: {r}", file=sys.stderr)
    ours = [r for r in rows if r["code"] == "this tree"]
    goals = [common.Goal("controller memory growth under the flood (worst round)", max(r["grown_MiB"] for r in ours),
                         16, "MiB"),
             common.Goal("log lines for the flood (worst round)", max(r["log_lines"] for r in ours), 4, "lines")]
    common.report("preauth", rows, ["code", "round", "calls", "body_MiB", "rss_before_MiB", "peak_MiB", "grown_MiB",
                                    "refused", "log_lines", "flood_s"], goals, quick=a.quick, out=a.out,
                  extra={"baseline": str(a.baseline) if a.baseline else None})


if __name__ == "__main__":
    main()
