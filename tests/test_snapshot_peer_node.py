"""A lost node reloads from its peer's memory: two ``trainguard run`` node
agents on loopback (``--nnodes 2``, one rank each, snapshots every step with
a copy on the other node). The whole second node is killed (agent and
worker); the survivor dumps from its snapshot and exits 75; torch restarts
the group (``--max-restarts``) with a replacement agent in the lost node's
place; rank 0 resumes from its own memory, rank 1 -- on the new node, with no
snapshot of its own -- from the copy its old node had pushed to node 0, and
the job ends bit-identical to a fault-free run of the same topology."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from conftest import WORKERS

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _secret_file(tmp: Path) -> Path:
    path = tmp / "job-secret"
    path.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
    path.chmod(0o400)
    return path


def run_nodes(tmp: Path, name: str, *, lose_after_s: float = 0.0) -> tuple[list, dict]:
    """Two node agents; with ``lose_after_s``, SIGKILL the node without the
    controller (agent and worker) that long after training starts, then
    start a replacement agent. Returns ``[(exit code, log)]`` per agent and
    ``{rank: report}``."""
    import torch.distributed as dist

    port = _free_port()
    # Served from here, so that either node may be lost (on a cluster: etcd,
    # or an endpoint outside the workers' nodes).
    rendezvous = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False)
    job = f"{name}-{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_HEARTBEAT_INTERVAL_S="0.5", TRAINGUARD_PRELOCK_TIMEOUT_S="20", TRAINGUARD_STRATEGIES="dump",
               PYTHONUNBUFFERED="1", SNAPSHOT_PEER="1", SNAP_STEP_SLEEP="0.1",
               TRAINGUARD_TOKEN_FILE=str(_secret_file(tmp)))  # two nodes: one secret, as a mounted Secret
    cmd = [sys.executable, "-m", "trainguard.cli", "run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job, "--job-id", job,
           "--monitor-interval", "0.1", "--max-restarts", "2", str(WORKERS / "snapshot_train.py"), "30",
           str(tmp / f"{name}.json"), str(tmp / f"{name}-ckpt"), "100"]
    nodes, logs, victim = [], [], None

    def start() -> subprocess.Popen:
        node = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log: list[str] = []
        threading.Thread(target=lambda: log.extend(node.stdout), daemon=True).start()
        nodes.append(node)
        logs.append(log)
        return node

    start(), start()
    try:
        if lose_after_s:
            deadline = time.time() + 120
            while time.time() < deadline and not any("ranks registered" in x for log in logs for x in list(log)):
                time.sleep(0.05)
            time.sleep(lose_after_s)
            victim = next(n for n, log in zip(nodes, logs) if not any("controller listening" in x for x in list(log)))
            # Kill just after a push of rank 1's newest snapshot landed on the other node: its next
            # snapshot is a step (0.1 s of sleep) away, so the peer holds the step the dump locks.
            copy = next(Path("/dev/shm").glob(f"trainguard-{job}-{next(n for n in nodes if n is not victim).pid}-*")) / "peer" / "r1"

            def pushed() -> int | None:
                try:
                    return copy.stat().st_ino  # each push renames a new file into place
                except FileNotFoundError:
                    return None
            seen, until = pushed(), time.time() + 30
            while pushed() == seen and time.time() < until:
                time.sleep(0.002)
            workers = subprocess.run(["pgrep", "-P", str(victim.pid)], capture_output=True, text=True).stdout.split()
            for pid in [victim.pid, *map(int, workers)]:
                os.kill(pid, signal.SIGKILL)
            start()  # the replacement node
        codes = [n.wait(timeout=180) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
        del rendezvous
    time.sleep(0.2)  # the readers' last lines
    # The agents that exit remove their snapshots; the killed one cannot, and
    # the next owner created on its host removes them: the replacement agent,
    # which starts after the kill (the killed agent, a zombie until this test
    # reaps it, counts as gone). Any other owner on the host may sweep first.
    left = list(Path("/dev/shm").glob(f"trainguard-{job}-*"))
    assert left == [], f"snapshots left behind: {left}"
    reports = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp.glob(f"{name}.json.[0-9]")}
    return [(code, "".join(log)) for code, log in zip(codes, logs)], reports


def test_a_lost_node_reloads_from_its_peers_memory_bit_identical(tmp_path):
    outs, reference = run_nodes(tmp_path, "plain")
    assert [code for code, _ in outs] == [0, 0], "\n".join(log[-3000:] for _, log in outs)
    # the fault-free twin: its agents may restart (--max-restarts), and a restart there would go unseen
    assert {rank: rep["recoveries"] for rank, rep in reference.items()} == {0: [], 1: []}, reference
    plain_logs = outs
    outs, reports = run_nodes(tmp_path, "lost", lose_after_s=1.5)
    survivor, killed, replacement = outs
    assert killed[0] == -signal.SIGKILL and survivor[0] == 0 and replacement[0] == 0, \
        "\n".join(log[-3000:] for _, log in outs)
    resumed = {rank: rep["snapshots"]["resumed_from"] for rank, rep in reports.items()}
    step = resumed[0]["step"]
    assert step > 0 and resumed == {0: {"step": step, "source": "memory"}, 1: {"step": step, "source": "peer memory"}}
    assert f"sent rank 1's copy of step {step} back" in survivor[1]
    assert [(r["fault"], r["rank"], r["strategy"], r["step"]) for r in reports[0]["recoveries"]] == [
        ("process_lost", 1, "dump", step)]
    # both ranks at once, with what each run went through: a difference names its rank and shows both runs
    assert {rank: reports[rank]["final_state_sha256"] for rank in (0, 1)} == \
        {rank: reference[rank]["final_state_sha256"] for rank in (0, 1)}, "\n".join(
            [json.dumps({rank: {k: rep[k] for k in ("steps_completed", "recoveries", "snapshots")}
                         for rank, rep in reports.items()}, default=str)]
            + [log[-3000:] for _, log in outs] + ["--- the fault-free run:"] + [log[-1500:] for _, log in plain_logs])
