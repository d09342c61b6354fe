"""TaskD's API names (``trainguard.compat.taskd``): config checks, the worker's
mapping onto the Guard's environment, and a TaskD-style job -- ``manager.py``
in one process, plain ``torchrun`` workers calling
``init_taskd_worker``/``start_taskd_worker`` and then building a Guard."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from taskd_jobs import TOKEN, TaskdJob, free_port
from trainguard.compat import init_taskd_manager, init_taskd_worker, start_taskd_manager, start_taskd_worker
from trainguard.compat.taskd import TASKD_PORT
from trainguard.compat.taskd.api import taskd_manager_api, taskd_worker_api
from trainguard.compat.taskd.api.taskd_worker_api import destroy_taskd_worker
from trainguard.core import ConfigError, Processor, ProcessorConfig, ProtocolError, ReplicaGroup, TrainguardError

GOOD = {"job_id": "job-1", "node_nums": 2, "proc_per_node": 4}


@pytest.fixture(autouse=True)
def fresh_compat_state(monkeypatch):
    """Module globals and the TRAINGUARD_* environment are restored after each test."""
    monkeypatch.setattr(taskd_manager_api, "taskd_manager", None)
    monkeypatch.setattr(taskd_worker_api, "taskd_worker", None)
    monkeypatch.setattr(taskd_worker_api, "_previous_controller", None)
    touched = {"TRAINGUARD_CONTROLLER", "TRAINGUARD_PORT", "TRAINGUARD_HOST", "MASTER_ADDR", "MS_SCHED_HOST"}
    for name in touched | {n for n in os.environ if n.startswith("TRAINGUARD_")}:
        monkeypatch.setenv(name, "")  # records the original, so that teardown restores it
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRAINGUARD_TOKEN", TOKEN)


# ------------------------------------------------------------ manager config
@pytest.mark.timeout(10)
@pytest.mark.parametrize("config, expected", [
    (["job-1", 2, 4], "takes a dict such as"),
    ({"job_id": "j", "node_nums": 2}, "missing 'proc_per_node'"),
    ({}, "missing 'job_id'.*missing 'node_nums'.*missing 'proc_per_node'"),
    (dict(GOOD, job_id=None), r"'job_id' must be a non-empty str, got None \(is MINDX_TASK_ID set\?\)"),
    (dict(GOOD, job_id=""), "'job_id' must be a non-empty str"),
    (dict(GOOD, node_nums="2"), "'node_nums' must be an int >= 1, got str '2'"),
    (dict(GOOD, node_nums=True), "'node_nums' must be an int >= 1, got bool True"),
    (dict(GOOD, proc_per_node=0), "'proc_per_node' must be an int >= 1, got int 0"),
    (dict(GOOD, proc_per_nodes=8), "unknown key 'proc_per_nodes'; did you mean 'proc_per_node'"),
    (dict(GOOD, colour="red"), "unknown key 'colour' \\(known: job_id, node_nums"),
    (dict(GOOD, plugin_dir="/x"), "'plugin_dir' is a TaskD key trainguard does not support"),
    (dict(GOOD, cluster_infos={"ip": "10.0.0.1"}), "'cluster_infos'.*TRAINGUARD_HOST and TRAINGUARD_PORT"),
    (dict(GOOD, fault_recover="off"), "'fault_recover'='off'.*only 'on' is accepted"),
])
def test_bad_manager_config_is_refused_with_the_reason(config, expected):
    with pytest.raises(ConfigError, match=expected):
        init_taskd_manager(config)
    assert taskd_manager_api.taskd_manager is None


@pytest.mark.timeout(10)
def test_every_problem_is_named_at_once():
    with pytest.raises(ConfigError) as info:
        init_taskd_manager({"job_id": 7, "node_num": 2, "proc_per_node": -1})
    text = str(info.value)
    for part in ("'job_id' must be a non-empty str, got 7", "missing 'node_nums'", "'proc_per_node' must be",
                 "unknown key 'node_num'; did you mean 'node_nums'"):
        assert part in text


@pytest.mark.timeout(10)
def test_manager_config_maps_onto_a_controller(monkeypatch):
    assert init_taskd_manager(dict(GOOD, fault_recover="on", taskd_enable="on")) is True
    manager = taskd_manager_api.taskd_manager
    assert manager.world_size == 8
    assert (manager.config.job_id, manager.config.host, manager.config.port) == ("job-1", "127.0.0.1", TASKD_PORT)

    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")  # TaskD's recipe: export MASTER_ADDR=${POD_IP}
    init_taskd_manager(GOOD)
    assert (taskd_manager_api.taskd_manager.config.host, taskd_manager_api.taskd_manager.config.port) \
        == ("10.1.2.3", 9601)

    monkeypatch.setenv("TRAINGUARD_HOST", "0.0.0.0")
    monkeypatch.setenv("TRAINGUARD_PORT", "19601")
    init_taskd_manager(GOOD)
    assert (taskd_manager_api.taskd_manager.config.host, taskd_manager_api.taskd_manager.config.port) \
        == ("0.0.0.0", 19601)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("env, expected", [
    ({"TRAINGUARD_TOKEN": None}, "TaskD manager .*needs a shared secret.*every pod.*TRAINGUARD_TOKEN_FILE"),
    ({"TRAINGUARD_TOKEN": "short"}, "at least 16 printable characters"),
    ({"TRAINGUARD_TOKEN": "a secret with spaces"}, "without blanks"),
    ({"TRAINGUARD_PORT": "0"}, r"TRAINGUARD_PORT='0' is not a port in \[1, 65535\]"),
    ({"TRAINGUARD_PORT": "96O1"}, "is not a port"),
    ({"TRAINGUARD_STRATEGY": "dump"}, "unknown setting TRAINGUARD_STRATEGY; did you mean TRAINGUARD_STRATEGIES"),
])
def test_manager_refuses_a_bad_environment(monkeypatch, env, expected):
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=expected):
        init_taskd_manager(GOOD)


@pytest.mark.timeout(10)
def test_start_before_init_is_refused():
    with pytest.raises(TrainguardError, match=r"before init_taskd_manager\(config\)"):
        start_taskd_manager()
    with pytest.raises(TrainguardError, match=r"before init_taskd_worker\(rank\)"):
        start_taskd_worker()


@pytest.mark.timeout(30)
def test_taskd_names_import_without_any_framework():
    """A MindSpore process (or the manager's pod) must not need torch."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "mindspore", "megatron"}:
            raise ImportError(f"blocked framework import: {name}")
sys.meta_path.insert(0, Block())
from trainguard.compat.taskd.api import init_taskd_manager, start_taskd_manager
from trainguard.compat.taskd.api.taskd_worker_api import init_taskd_worker, start_taskd_worker
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr


# ------------------------------------------------------------------ worker
@pytest.mark.timeout(10)
@pytest.mark.parametrize("args, expected", [
    ((-1,), "rank_id must be >= 0, got -1"),
    (("0",), "rank_id must be an int, got str '0'"),
    ((True,), "rank_id must be an int, got bool"),
    ((0, -5), "upper_limit_of_disk_in_mb must be >= 0, got -5"),
    ((0, 5000.0), "upper_limit_of_disk_in_mb must be an int, got float"),
    ((0, 5000, "tf"), r"framework must be one of \['ms', 'pt'\], got 'tf'"),
])
def test_bad_worker_arguments_are_refused(args, expected):
    with pytest.raises(ConfigError, match=expected):
        init_taskd_worker(*args)
    assert taskd_worker_api.taskd_worker is None


@pytest.mark.timeout(10)
def test_worker_points_the_guard_at_the_manager(monkeypatch):
    monkeypatch.delenv("TRAINGUARD_PROFILING_CAP_MB", raising=False)  # restored to unset afterwards
    assert init_taskd_worker(3, 2048) is True
    assert taskd_worker_api.taskd_worker.upper_limit_of_disk_in_mb == 2048
    with pytest.raises(ConfigError, match=r"MASTER_ADDR is not set.*export MASTER_ADDR=\$\{POD_IP\}"):
        start_taskd_worker()
    assert "TRAINGUARD_CONTROLLER" not in os.environ

    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert start_taskd_worker() is True
    assert os.environ["TRAINGUARD_CONTROLLER"] == "10.1.2.3:9601"
    assert os.environ["TRAINGUARD_PROFILING_CAP_MB"] == "2048"  # the Guard's profiling cap
    config = ProcessorConfig.from_env(rank=3, world_size=8)  # what the Guard reads
    assert (config.controller, config.token, config.rank) == ("10.1.2.3:9601", TOKEN, 3)

    monkeypatch.setenv("TRAINGUARD_PORT", "19601")
    monkeypatch.setenv("MASTER_ADDR", "fd00::5")
    start_taskd_worker()
    assert os.environ["TRAINGUARD_CONTROLLER"] == "[fd00::5]:19601"
    assert destroy_taskd_worker() is True
    assert "TRAINGUARD_CONTROLLER" not in os.environ and taskd_worker_api.taskd_worker is None

    init_taskd_worker(0, framework="ms")
    monkeypatch.setenv("MS_SCHED_HOST", "10.9.9.9")
    start_taskd_worker()
    assert os.environ["TRAINGUARD_CONTROLLER"] == "10.9.9.9:19601"


@pytest.mark.timeout(10)
def test_worker_keeps_a_controller_set_by_trainguard_run(monkeypatch):
    monkeypatch.setenv("TRAINGUARD_CONTROLLER", "127.0.0.1:4242")  # the agent's relay
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    init_taskd_worker(0)
    start_taskd_worker()
    assert os.environ["TRAINGUARD_CONTROLLER"] == "127.0.0.1:4242"
    destroy_taskd_worker()
    assert os.environ["TRAINGUARD_CONTROLLER"] == "127.0.0.1:4242"


@pytest.mark.timeout(20)
def test_worker_rank_must_match_torch_distributed(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        init_taskd_worker(1)
        with pytest.raises(ConfigError, match="given rank 1 but torch.distributed says this process is rank 0"):
            start_taskd_worker()
        init_taskd_worker(0)
        assert start_taskd_worker() is True
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(10)
def test_worker_needs_the_job_token(monkeypatch):
    monkeypatch.delenv("TRAINGUARD_TOKEN")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    init_taskd_worker(0)
    with pytest.raises(ConfigError, match="TaskD worker .*needs a shared secret.*TRAINGUARD_TOKEN"):
        start_taskd_worker()



@pytest.mark.timeout(10)
def test_worker_reads_the_job_secret_from_a_mounted_file(monkeypatch, tmp_path):
    """As the manager does: a Kubernetes Secret mounted as a file; the worker's
    Guard then finds it in TRAINGUARD_TOKEN."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "token").chmod(0o400)  # as a Kubernetes Secret mounted defaultMode 0400 (others may not read it)
    monkeypatch.delenv("TRAINGUARD_TOKEN")
    monkeypatch.setenv("TRAINGUARD_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    init_taskd_worker(0)
    assert start_taskd_worker() is True
    assert os.environ["TRAINGUARD_TOKEN"] == TOKEN


# ------------------------------------------------------ manager, in-process
def _manager_thread(monkeypatch, world: int = 2):
    port = free_port()
    monkeypatch.setenv("TRAINGUARD_PORT", str(port))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("TRAINGUARD_HEARTBEAT_INTERVAL_S", "0.2")
    init_taskd_manager({"job_id": "job-t", "node_nums": 1, "proc_per_node": world})
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(returned=start_taskd_manager()), name="test-manager")
    thread.start()
    return thread, result, port


@pytest.mark.timeout(30)
def test_manager_returns_when_every_rank_finished(monkeypatch):
    thread, result, port = _manager_thread(monkeypatch)
    procs = []
    try:
        for rank in (0, 1):
            init_taskd_worker(rank)
            start_taskd_worker()
            p = Processor(ProcessorConfig.from_env(rank=rank, world_size=2), force_exit=lambda code: None)
            p.connect(replicas=[ReplicaGroup.full(range(2))])
            procs.append(p)
        intruder = ProcessorConfig(controller=f"127.0.0.1:{port}", token="f" * 64, rank=1, world_size=2,
                                   connect_timeout_s=5)
        with pytest.raises(ProtocolError, match="did not prove it knows the job secret"):  # nor does it prove its
            Processor(intruder, force_exit=lambda code: None).connect()
        assert thread.is_alive()  # waiting for the ranks to finish
        for p in procs:
            p.start_update()
            p.end_update(1)
            p.close(finished=True)
        thread.join(10)
    finally:
        taskd_manager_api.taskd_manager.stop()
        thread.join(10)
    assert result == {"returned": True}
    (status,) = taskd_manager_api.taskd_manager.attempts
    assert status["state"] == "FINISHED" and status["address"] == f"127.0.0.1:{port}"
    assert {r: (s["run"], s["step"]) for r, s in status["ranks"].items()} == {"0": ("FINISHED", 1),
                                                                              "1": ("FINISHED", 1)}


@pytest.mark.timeout(20)
def test_a_stopped_manager_returns_false(monkeypatch):
    thread, result, _ = _manager_thread(monkeypatch)
    taskd_manager_api.taskd_manager.stop()
    thread.join(10)
    assert result == {"returned": False}
    assert taskd_manager_api.taskd_manager.status["state"] == "INIT"


# ------------------------------------------- a TaskD job: manager.py + torchrun
@pytest.fixture
def taskd_job(tmp_path):
    jobs: list[TaskdJob] = []

    def start(**kwargs) -> TaskdJob:
        jobs.append(TaskdJob(tmp_path, **kwargs))
        return jobs[-1]

    yield start
    for job in jobs:
        job.close()


@pytest.mark.timeout(60)
def test_taskd_job_runs_under_the_manager(taskd_job):
    job = taskd_job()
    rc, out, reports = job.torchrun(steps=6)
    assert rc == 0, out[-4000:]
    m_rc, m_out, result = job.manager_result()
    assert m_rc == 0, m_out[-4000:]
    assert result["returned"] is True
    (status,) = result["attempts"]
    assert status["state"] == "FINISHED" and status["job_id"] == "job-taskd"
    assert status["address"] == f"127.0.0.1:{job.port}"
    # The manager saw both real ranks register (their pids) and finish at the last step.
    assert sorted(reports) == [0, 1]
    assert status["pids"] == {str(r): [reports[r]["pid"]] for r in (0, 1)}
    assert {r: (s["run"], s["step"]) for r, s in status["ranks"].items()} == {"0": ("FINISHED", 6),
                                                                              "1": ("FINISHED", 6)}
    for rank, report in reports.items():
        assert report["controller"] == f"127.0.0.1:{job.port}"
        assert report["steps_completed"] == 6
    assert reports[0]["final_state_sha256"] == reports[1]["final_state_sha256"]
    assert "all 2 ranks registered" in m_out and "job job-taskd finished" in m_out


@pytest.mark.timeout(90)
def test_dying_gasp_then_relaunch_resumes_under_the_same_manager(taskd_job):
    job = taskd_job(manager_env={"TRAINGUARD_STRATEGIES": "dump,exit"}, max_restarts=1)
    rc, out, reports = job.torchrun(steps=6, fault="uce:rank=1,step=3,phase=backward")
    assert rc != 0 and not reports, out[-4000:]  # both ranks left with 75 after the dump
    assert job.manager.poll() is None, "the manager must wait for the relaunch"
    rc, out, reports = job.torchrun(steps=6)  # the same command again, as a rescheduled pod would
    assert rc == 0, out[-4000:]
    m_rc, m_out, result = job.manager_result()
    assert m_rc == 0 and result["returned"] is True, m_out[-4000:]
    first, second = result["attempts"]
    assert first["state"] == "EXITED" and second["state"] == "FINISHED"
    (dump,) = first["recoveries"]
    assert (dump["strategy"], dump["step"], dump["lost_steps"]) == ("dump", 3, 0)
    assert "dying-gasp checkpoint at step 3" in m_out and "waiting for the relaunched ranks" in m_out
    for rank in (0, 1):
        assert second["pids"][str(rank)] == [reports[rank]["pid"]]
        assert first["pids"][str(rank)] != second["pids"][str(rank)]
        assert reports[rank]["steps_completed"] == 6 and reports[rank]["lost_steps"] == 0


@pytest.mark.timeout(60)
def test_manager_without_restarts_left_raises_after_the_dump(taskd_job):
    job = taskd_job(manager_env={"TRAINGUARD_STRATEGIES": "dump,exit"}, max_restarts=0)
    rc, out, _ = job.torchrun(steps=6, fault="uce:rank=0,step=2,phase=backward")
    assert rc != 0, out[-4000:]
    m_rc, m_out, result = job.manager_result()
    assert m_rc == 0, m_out[-4000:]
    assert "returned" not in result
    assert result["stopped"]["exit_code"] == 75 and result["stopped"]["step"] == 2
    assert "relaunch it to resume from that step" in result["stopped"]["message"]
    assert [a["state"] for a in result["attempts"]] == ["EXITED"]
