"""Real multi-host jobs: three hosts built from network namespaces on this
machine (``tests/netns.py``: a veth pair on a bridge and an address each),
one ``trainguard run`` node agent per host (``tests/multihost_jobs.py``),
torch's c10d rendezvous on host 0's address, gloo between the hosts'
addresses. Faults strike a whole host: every process of its namespace
killed (host lost) or stopped (frozen host), its link cut for a while or
for good (partition), or slowed (a token bucket, ``Hosts.rate_limit``: this
VM's kernel has no netem).

Each test asserts outcomes (strategy, exit codes, surviving PIDs, final state
against a fault-free run of the same topology) and writes what it measured
(detection, recovery, lost steps, survivors) to ``multihost-<name>.json``
in its temporary directory and to its captured output; no assertion on time.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import WORKERS

import netns
from multihost_jobs import (STEPS, checkpoints, dump_records, finish, record, run_clean, start_job,
                            strike_after_start, verify, victim_rank)

pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]


@pytest.fixture
def hosts():
    reason = netns.why_not()
    if reason:
        pytest.skip(reason)
    h = netns.Hosts(3)
    try:
        yield h
    finally:
        h.close()


# ---------------------------------------------------------------------------- tests
def test_hosts_are_separate_networks_and_are_removed(hosts):
    """Each host reaches the others at their addresses; the fixture's
    cleanup leaves no namespace, link or process behind."""
    code = "import socket,sys; s=socket.create_connection((sys.argv[1], 5555), timeout=5); s.sendall(b'x')"
    server = hosts.popen(1, [sys.executable, "-c", "import socket; s=socket.socket(); s.bind(('0.0.0.0', 5555)); "
                             "s.listen(); c,_=s.accept(); print(c.recv(1).decode())"],
                         stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert hosts.pids(1) == [server.pid]
    hosts.exec(0, sys.executable, "-c", code, hosts.addr[1])
    assert server.communicate(timeout=10)[0].strip() == "x"
    hosts.link_down(2)
    with pytest.raises(RuntimeError):
        hosts.exec(2, sys.executable, "-c", code.replace("timeout=5", "timeout=1"), hosts.addr[1])
    hosts.link_up(2)
    sleeper = hosts.popen(2, ["sleep", "600"])
    hosts.close()
    assert sleeper.wait(timeout=10) == -9
    assert netns.leftovers() == []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run of the same topology (3 hosts x 1 rank)."""
    reason = netns.why_not()
    if reason:
        pytest.skip(reason)
    with netns.Hosts(3) as h:
        job = run_clean(h, tmp_path_factory.mktemp("reference"), "reference")
    assert job.report["steps_completed"] == STEPS
    return job.report


# A dump saves the newest step every surviving rank has: 1 step is done
# again when the host went away in the middle of an all-reduce that some
# survivors finished and others did not (decide.py: _dump_step).
_DUMP_LOST = (0, 1)


LM = WORKERS / "lm_train.py"
LM_ENV = {"LM_STEP_SLEEP": "0.2"}  # a 6 s job, as tiny_train's


def _lm_args(tmp: Path, name: str) -> list[str]:
    return [str(STEPS), str(tmp / f"{name}.json"), str(tmp / f"{name}-ckpt")]


def _lm_ranks(tmp: Path, name: str) -> dict[int, dict]:
    """Every rank's report of an lm_train job: final state, random stream, data position."""
    out = {0: json.loads((tmp / f"{name}.json").read_text())}
    out.update({int(p.name.rsplit("rank", 1)[1]): json.loads(p.read_text())
                for p in tmp.glob(f"{name}.json.rank*")})
    return out


@pytest.fixture(scope="module")
def lm_reference(tmp_path_factory):
    """The fault-free run of a model with dropout fed by a DistributedSampler (3 hosts x 1 rank)."""
    reason = netns.why_not()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("lm-reference")
    with netns.Hosts(3) as h:
        run_clean(h, tmp, "lm-ref", script=LM, script_args=_lm_args(tmp, "lm-ref"), env_extra=LM_ENV)
    ranks = _lm_ranks(tmp, "lm-ref")
    assert sorted(ranks) == [0, 1, 2] and ranks[0]["steps_completed"] == STEPS
    return ranks


def test_a_lost_host_s_ranks_resume_on_a_spare_slot_of_another_host_bit_identical(hosts, tmp_path, lm_reference):
    """Every process of one host SIGKILLed (agent and worker: the host is
    gone), on a model with dropout fed by a DistributedSampler. With
    ``recover`` and a spare slot on each host, another host's agent starts
    the lost rank, with its random streams and data position from the copy
    of its record the next host kept; the survivors keep their PIDs, nothing
    is lost and every rank ends bit-identical to the fault-free run, random
    streams and data position included."""
    job = start_job(hosts, tmp_path, "lost", strategies="recover,dump", spare=1, script=LM,
                    script_args=_lm_args(tmp_path, "lost"), env_extra=LM_ENV)
    victim = strike_after_start(job)
    job.events["strike"] = time.time()
    job.events["killed_pids"] = hosts.kill_host(victim)
    job.events["victim_host"] = victim
    finish(job, skip=(victim,))
    out = record(job)
    survivors = [c for i, c in enumerate(job.codes) if i != victim]
    assert survivors == [0, 0], job.all_logs()
    (rec,) = job.report["recoveries"]
    lost_rank = victim_rank(job, victim)
    assert (rec["fault"], rec["rank"], rec["strategy"], rec["lost_steps"]) == (
        "process_lost", lost_rank, "recover", 0), rec
    pids = job.report["pids"]
    assert len(pids[str(lost_rank)]) == 2 and all(len(p) == 1 for r, p in pids.items() if int(r) != lost_rank), pids
    assert pids[str(lost_rank)][0] in job.events["killed_pids"]
    assert job.report["steps_completed"] == STEPS
    assert "from its seed" not in job.all_logs() and "took the copy of" in job.all_logs(), job.all_logs()
    ours = _lm_ranks(tmp_path, "lost")
    for rank in range(3):
        for key in ("final_state_sha256", "rng_sha256", "data"):
            assert ours[rank][key] == lm_reference[rank][key], (rank, key)
    assert out["recoveries"][0]["strategy"] == "recover"


@pytest.mark.slow  # CI: the frozen host under recover, and the 10 s partition's dump
def test_a_frozen_host_is_detected_and_the_job_stops_after_a_dying_gasp_checkpoint(hosts, tmp_path):
    """Every process of one host SIGSTOPped (agent and worker: nobody on it
    can act, and its connections stay open). The controller misses its
    rank's heartbeats within seconds; ``dump`` saves the last consistent
    step from the survivors and both surviving hosts exit 75 (relaunch to
    resume); nothing newer is written. The frozen processes are still
    there, stopped, when the survivors have exited."""
    job = start_job(hosts, tmp_path, "frozen", strategies="dump", max_restarts=0)
    victim = strike_after_start(job)
    job.events["strike"] = time.time()
    job.events["frozen_pids"] = hosts.freeze_host(victim)
    job.events["victim_host"] = victim
    for i in range(hosts.n):
        if i != victim:
            job.agents[i].wait(timeout=120)
    job.events["still_stopped"] = [p for p in job.events["frozen_pids"]
                                   if Path(f"/proc/{p}/stat").read_text().split(")")[1].split()[0] == "T"]
    finish(job, skip=(victim,))
    out = record(job, checkpoints=checkpoints(job))
    assert [c for i, c in enumerate(job.codes) if i != victim] == [75, 75], job.all_logs()
    assert "relaunch the same command to resume" in job.log(0)
    (rec,) = dump_records(job)
    assert (rec["fault"], rec["rank"], rec["strategy"]) == ("hang", victim_rank(job, victim), "dump"), rec
    assert rec["lost_steps"] in _DUMP_LOST, rec
    assert checkpoints(job) == [rec["step"]] and rec["step"] > 0
    verify(job)
    assert sorted(job.events["still_stopped"]) == sorted(job.events["frozen_pids"])
    assert out["detected_after_strike_s"] is not None


@pytest.mark.parametrize("fault", ["frozen", pytest.param("cut", marks=pytest.mark.slow)])
def test_a_frozen_or_cut_off_host_s_rank_resumes_on_a_spare_slot_of_another_host_bit_identical(
        hosts, tmp_path, reference, fault):
    """Every process of one host stopped (``frozen``), or its link down for
    good (``cut``): its processes live on and its connections stay open
    (or time out slowly), so nothing closes a socket. With ``recover`` and
    a spare slot on each host, another host starts the lost rank and the
    survivors meet it; they keep their PIDs, nothing is lost, training
    ends bit-identical, and both surviving hosts exit 0 without waiting
    for the unreachable host's agent. (The survivors' old group, its
    collective with the unreachable peer still pending, used to be
    destroyed on the training thread, which then waited on that peer for
    good; CI: ``frozen``.)"""
    job = start_job(hosts, tmp_path, f"{fault}-recover", strategies="recover,dump", spare=1)
    victim = strike_after_start(job)
    job.events["strike"] = time.time()
    job.events["victim_host"] = victim
    if fault == "frozen":
        job.events["frozen_pids"] = hosts.freeze_host(victim)
    else:
        hosts.link_down(victim)
    for i in range(hosts.n):
        if i != victim:
            job.agents[i].wait(timeout=120)
    job.events["victim_still_there"] = job.agents[victim].poll() is None
    finish(job, skip=(victim,))
    out = record(job)
    assert [c for i, c in enumerate(job.codes) if i != victim] == [0, 0], job.all_logs()
    (rec,) = job.report["recoveries"]
    lost_rank = victim_rank(job, victim)
    assert (rec["fault"], rec["rank"], rec["strategy"], rec["lost_steps"]) == ("hang", lost_rank, "recover", 0), rec
    pids = job.report["pids"]
    assert len(pids[str(lost_rank)]) == 2 and all(len(p) == 1 for r, p in pids.items() if int(r) != lost_rank), pids
    if fault == "frozen":
        assert pids[str(lost_rank)][0] in job.events["frozen_pids"]
    assert job.events["victim_still_there"]  # the survivors finished without it
    assert job.report["steps_completed"] == STEPS
    assert job.report["final_state_sha256"] == reference["final_state_sha256"]
    assert out["recoveries"][0]["strategy"] == "recover"


def test_a_host_cut_off_for_10_s_is_detected_and_the_job_resumes_bit_identical(hosts, tmp_path, reference):
    """One host's link down for 10 s, then up. Its rank falls silent: the
    job dumps at the last consistent step; the survivors' agents wait in
    torch's next rendezvous round (``--max-restarts 1``) for the cut-off
    host, whose agent joins once the link is back; the group resumes from
    the dump and ends bit-identical to the fault-free run."""
    job = start_job(hosts, tmp_path, "partition", strategies="dump", max_restarts=1)
    victim = strike_after_start(job)
    job.events["strike"] = time.time()
    hosts.link_down(victim)
    job.events["victim_host"] = victim
    time.sleep(10)
    hosts.link_up(victim)
    job.events["link_up"] = time.time()
    finish(job)
    out = record(job, checkpoints=checkpoints(job))
    assert job.codes == [0, 0, 0], job.all_logs()
    (rec,) = job.report["recoveries"]
    assert (rec["fault"], rec["rank"], rec["strategy"]) == ("hang", victim_rank(job, victim), "dump"), rec
    assert rec["lost_steps"] in _DUMP_LOST, rec
    assert rec["detected_at"] < job.events["link_up"]  # found while the host was cut off
    assert checkpoints(job) == [rec["step"]]
    assert all(len(p) == 2 for p in job.report["pids"].values())  # torch restarted the group once
    assert job.report["steps_completed"] == STEPS
    assert job.report["final_state_sha256"] == reference["final_state_sha256"]
    assert out["recoveries"][0]["strategy"] == "dump"


@pytest.mark.slow  # CI: the frozen host (the same stop) and the 10 s partition
def test_a_host_cut_off_for_good_leaves_a_dying_gasp_checkpoint_the_job_resumes_from(hosts, tmp_path, reference):
    """One host's link down for good: the two others dump and exit 75
    (nothing newer is written); relaunched on three hosts (the cut-off one
    replaced), the job resumes from the dump and ends bit-identical."""
    job = start_job(hosts, tmp_path, "cut", strategies="dump", max_restarts=0)
    victim = strike_after_start(job)
    job.events["strike"] = time.time()
    hosts.link_down(victim)
    job.events["victim_host"] = victim
    for i in range(hosts.n):
        if i != victim:
            job.agents[i].wait(timeout=120)
    job.events["cut_off_host_still_running"] = job.agents[victim].poll() is None
    finish(job, skip=(victim,))
    out = record(job, checkpoints=checkpoints(job))
    assert [c for i, c in enumerate(job.codes) if i != victim] == [75, 75], job.all_logs()
    (rec,) = dump_records(job)
    assert (rec["fault"], rec["rank"], rec["strategy"]) == ("hang", victim_rank(job, victim), "dump"), rec
    assert checkpoints(job) == [rec["step"]]
    verify(job)
    hosts.link_up(victim)  # the host replaced
    again = finish(start_job(hosts, tmp_path, "cut", strategies="dump", max_restarts=0))
    assert again.codes == [0, 0, 0], again.all_logs()
    assert again.report["final_state_sha256"] == reference["final_state_sha256"]
    assert out["recoveries"][0]["strategy"] == "dump"


ALL_ON = '{"CommunicationOperator":"on","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}'


@pytest.mark.slow  # CI: tests/test_links.py (the survey, the detection that starts it) and bench/multihost.py
def test_a_slow_link_is_named_by_its_host_and_the_job_goes_on(hosts, tmp_path):
    """One host's link limited to 2 Mbit/s (both ways) once the job runs,
    with every profiling marker on. Every rank's step slows alike (they all
    wait for the same all-reduce), so no rank's compute stands out: the
    live detection sees a job-wide slowdown of communication, the
    controller has the node agents probe their links to each other, and
    names the slowed host and its rank. The job goes on (no fault, no
    recovery) and ends when the link is freed again."""
    prof = tmp_path / "prof"
    prof.mkdir()
    (prof / "profilingSwitch").write_text(ALL_ON)
    steps = 300
    job = start_job(hosts, tmp_path, "slowlink", strategies="recover,dump", spare=1, steps=steps,
                    env_extra={"TRAINGUARD_PROFILING_DIR": str(prof), "TINY_STEP_SLEEP": "0.05"})
    victim = strike_after_start(job, 12.0)  # a baseline of fast steps first
    job.events["limited"] = time.time()
    job.events["qdisc"] = hosts.rate_limit(victim, "2mbit")
    job.events["victim_host"] = victim
    named = job.wait_for("slow node: ranks [", timeout=150)
    job.events["named_after_s"] = round(named - job.events["limited"], 2)
    hosts.unlimit(victim)
    finish(job)
    out = record(job)
    rank = victim_rank(job, victim)
    (line,) = [x for x in job.log(job.controller_host()).splitlines() if "slow node: ranks [" in x]
    assert f"slow node: ranks [{rank}]: the link of {socket.gethostname()}:{job.agents[victim].pid} is slow" in line, line
    assert "job-wide slowdown" in job.log(job.controller_host())  # what started the survey
    assert job.codes == [0, 0, 0], job.all_logs()
    assert job.report["recoveries"] == [] and job.report["steps_completed"] == steps
    named = [v for v in json.loads((prof / "slowlink" / "slow_nodes.json").read_text())["links"] if v["slow_node"]]
    assert [(v["slow_node"], v["ranks"]) for v in named] == [(f"{socket.gethostname()}:{job.agents[victim].pid}", [rank])]
    assert out["events"]["named_after_s"] > 0


def _pushed(job_id: str, rank: int) -> dict:
    """The inode of each copy of ``rank``'s snapshot held for it by another host (each push renames a new file)."""
    out = {}
    for p in Path("/dev/shm").glob(f"trainguard-{job_id}-*/peer/r{rank}"):
        try:
            out[str(p)] = p.stat().st_ino
        except FileNotFoundError:
            pass
    return out


@pytest.mark.slow  # CI: test_snapshot_peer_node (the same on loopback) and the lost host here
def test_a_lost_host_s_rank_resumes_from_its_peer_host_s_memory_bit_identical(hosts, tmp_path):
    """Snapshots every step, each host pushing its copy to the next host
    over the network. One host is lost (every process killed) just after
    a push; the others dump from memory and exit; torch restarts the group
    (``--max-restarts``) with a replacement agent on the lost host's
    address; the lost rank resumes from the copy held in another host's
    memory and the job ends bit-identical to a fault-free run."""
    script = WORKERS / "snapshot_train.py"
    env = {"SNAPSHOT_PEER": "1", "SNAP_STEP_SLEEP": "0.1"}

    def args(name: str) -> list[str]:
        return ["30", str(tmp_path / f"{name}.json"), str(tmp_path / f"{name}-ckpt"), "100"]

    run_clean(hosts, tmp_path, "peer-ref", strategies="dump", max_restarts=2, script=script,
              script_args=args("peer-ref"), env_extra=env)
    ref_hashes = {int(p.suffix[1:]): json.loads(p.read_text())["final_state_sha256"]
                  for p in tmp_path.glob("peer-ref.json.[0-9]")}
    assert len(ref_hashes) == 3
    name = f"peer-{uuid.uuid4().hex[:6]}"
    job = start_job(hosts, tmp_path, name, strategies="dump", max_restarts=2, script=script,
                    script_args=args(name), env_extra=env)
    victim = strike_after_start(job, 1.5)
    rank = victim_rank(job, victim)
    seen, until = _pushed(name, rank), time.time() + 30
    while _pushed(name, rank) == seen and time.time() < until:  # kill just after a push landed
        time.sleep(0.002)
    job.events["strike"] = time.time()
    job.events["killed_pids"] = hosts.kill_host(victim)
    job.events["victim_host"] = victim
    job.agents[victim].wait(timeout=30)
    replacement = start_job(hosts, tmp_path, name, strategies="dump", max_restarts=2, script=script,
                            script_args=args(name), env_extra=env, only=victim)
    job.agents[victim], job.logs[victim] = replacement.agents[0], replacement.logs[0]
    finish(job)
    reports = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp_path.glob(f"{name}.json.[0-9]")}
    resumed = {r: rep["snapshots"]["resumed_from"] for r, rep in reports.items()}
    out = record(job, resumed_from=resumed)
    assert job.codes == [0, 0, 0], job.all_logs()
    step = resumed[0]["step"]
    assert step > 0 and {r["step"] for r in resumed.values()} == {step}, resumed
    assert resumed[rank]["source"] == "peer memory", resumed
    assert all(r["source"] == "memory" for k, r in resumed.items() if k != rank), resumed
    for r in range(3):
        assert reports[r]["final_state_sha256"] == ref_hashes[r], r
    assert out["recoveries"][0]["strategy"] == "dump"
    # The agents that exited removed their snapshots; the killed one's were swept by the replacement.
    assert list(Path("/dev/shm").glob(f"trainguard-{name}-*")) == []
