"""Settings read once where a process starts and handed down: a rank's
(:class:`RankConfig`) and a node launcher's (:class:`LaunchConfig`). Each
bad value is refused with its variable named; each good one reaches the
part that uses it, which no longer reads the environment itself."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from datetime import timedelta

import pytest

from trainguard.core import ConfigError, ControllerConfig, FaultInjector, FaultSpec
from trainguard.core.config import RankConfig, check_env
from trainguard.core.config_launch import LaunchConfig


@pytest.fixture
def clean_env(monkeypatch):
    """No ``TRAINGUARD_*`` variable of the test run leaks into the one read here."""
    for name in [n for n in os.environ if n.startswith("TRAINGUARD_")]:
        monkeypatch.delenv(name)
    return monkeypatch


# ------------------------------------------------------------------ a rank's
def test_a_rank_reads_its_faults_inner_backend_and_store_round_with_its_other_settings():
    got = RankConfig.from_env({"TRAINGUARD_FAULT": "uce:rank=1,step=2;crash:rank=0,step=3",
                               "TRAINGUARD_INNER_BACKEND": "nccl", "TRAINGUARD_STORE_ROUND": "41234",
                               "TORCHELASTIC_RUN_ID": "job-a"})
    assert got.faults == tuple(FaultSpec.parse("uce:rank=1,step=2;crash:rank=0,step=3"))
    assert (got.inner_backend, got.store_round, got.run_id) == ("nccl", "41234", "job-a")
    plain = RankConfig.from_env({})
    assert (plain.faults, plain.inner_backend, plain.store_round, plain.run_id) == ((), "gloo", None, "run")


@pytest.mark.parametrize("env, message", [
    ({"TRAINGUARD_INNER_BACKEND": "mpi"}, "TRAINGUARD_INNER_BACKEND='mpi': choose gloo or nccl"),
    ({"TRAINGUARD_INNER_BACKEND": "NCCL"}, "TRAINGUARD_INNER_BACKEND='NCCL': choose gloo or nccl"),
    ({"TRAINGUARD_FAULT": "uce:rank=1"}, "TRAINGUARD_FAULT: bad fault 'uce:rank=1': missing step"),
    ({"TRAINGUARD_FAULT": "boom:rank=1,step=2"}, "TRAINGUARD_FAULT: bad fault 'boom:rank=1,step=2'"),
])
def test_a_rank_refuses_a_bad_value_naming_its_variable(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        RankConfig.from_env(env)


def test_the_inner_backend_and_the_snapshot_staging_size_are_known_settings():
    # Both are documented (docs/megatron.md, docs/checkpoints.md); a Guard refused them as unknown before.
    known = {"TRAINGUARD_INNER_BACKEND": "nccl", "TRAINGUARD_SNAPSHOT_STAGING_MB": "16"}
    assert check_env(known) is None
    assert RankConfig.from_env(known).inner_backend == "nccl"
    with pytest.raises(ConfigError, match="unknown setting TRAINGUARD_SNAPSHOT_STAGING; did you mean "
                                          "TRAINGUARD_SNAPSHOT_STAGING_MB"):
        check_env({"TRAINGUARD_SNAPSHOT_STAGING": "16"})


def test_a_script_without_a_guard_reads_its_faults_by_the_same_rule():
    injector = FaultInjector.from_env(1, environ={"TRAINGUARD_FAULT": "uce:rank=1,step=2"}, world_size=2)
    assert injector.specs == tuple(FaultSpec.parse("uce:rank=1,step=2")) and injector.armed
    with pytest.raises(ConfigError, match="TRAINGUARD_FAULT: bad fault 'uce'"):
        FaultInjector.from_env(0, environ={"TRAINGUARD_FAULT": "uce"})


def test_the_workers_store_prefix_is_named_by_the_agent_s_round_else_by_the_restart_count():
    from trainguard.adapters.torch.comm import job_namespace

    assert job_namespace(RankConfig(run_id="job-a", store_round="41234", restart_count=2)) == "trainguard/job-a/41234"
    assert job_namespace(RankConfig(run_id="job-a", restart_count=2)) == "trainguard/job-a/2"
    assert job_namespace(RankConfig.from_env({})) == "trainguard/run/0"


def test_the_trainguard_backend_reads_the_rank_s_settings_once_or_takes_those_handed_to_it(monkeypatch):
    import torch.distributed as dist

    from trainguard.adapters.torch import backend
    from trainguard.adapters.torch.process_group import AbortableProcessGroup

    def group() -> AbortableProcessGroup:
        made = backend._create(dist.HashStore(), 0, 1, timedelta(seconds=5))
        assert made in backend.groups() and isinstance(made._inner, dist.ProcessGroupGloo)
        made.stop("test over")
        return made

    monkeypatch.setattr(backend, "_settings", None)  # this process made no trainguard group yet
    monkeypatch.setenv("TRAINGUARD_INNER_BACKEND", "gloo")
    group()
    monkeypatch.setenv("TRAINGUARD_INNER_BACKEND", "mpi")  # read at the first group only
    group()
    backend.configure(RankConfig(inner_backend="gloo"))
    assert backend._rank_settings() == RankConfig(inner_backend="gloo")
    group()


# ------------------------------------------------------------ a launcher's
def test_a_launcher_reads_its_settings_once():
    assert LaunchConfig.from_env({}) == LaunchConfig()
    got = LaunchConfig.from_env({"TRAINGUARD_FAULT": "crash:rank=3,step=1", "TRAINGUARD_JOB_ID": "j7",
                                 "TRAINGUARD_SPARE_SLOTS": "2", "TRAINGUARD_STANDBY": " Off",
                                 "TRAINGUARD_SNAPSHOT_ROOT": "/tmp/shm"})
    assert got == LaunchConfig(faults=tuple(FaultSpec.parse("crash:rank=3,step=1")), job_id="j7", spare_slots=2,
                               standby=False, snapshot_root="/tmp/shm")
    assert LaunchConfig.from_env({"TRAINGUARD_STANDBY": ""}).standby  # empty: the default, as before
    assert all(LaunchConfig.from_env({"TRAINGUARD_STANDBY": on}).standby for on in ("on", "1", "true", "TRUE"))
    assert not any(LaunchConfig.from_env({"TRAINGUARD_STANDBY": off}).standby for off in ("off", "0", "false"))


@pytest.mark.parametrize("env, message", [
    ({"TRAINGUARD_SPARE_SLOTS": "two"}, "TRAINGUARD_SPARE_SLOTS='two' must be a whole number >= 0"),
    ({"TRAINGUARD_SPARE_SLOTS": "-1"}, "TRAINGUARD_SPARE_SLOTS='-1' must be a whole number >= 0"),
    ({"TRAINGUARD_STANDBY": "maybe"}, "TRAINGUARD_STANDBY='maybe': use on or off"),
    ({"TRAINGUARD_FAULT": "crash:step=1"}, "TRAINGUARD_FAULT: bad fault 'crash:step=1'"),
    ({"TRAINGUARD_SPARE_SLOT": "1"}, "unknown setting TRAINGUARD_SPARE_SLOT; did you mean TRAINGUARD_SPARE_SLOTS?"),
])
def test_a_launcher_refuses_a_bad_value_naming_its_variable(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        LaunchConfig.from_env(env)


def test_a_launcher_s_help_is_shown_whatever_the_environment_holds(clean_env, capsys):
    from trainguard.launcher.run import launch

    clean_env.setenv("TRAINGUARD_SPARE_SLOTS", "two")
    with pytest.raises(SystemExit) as e:
        launch(["--help"])
    assert e.value.code == 0 and "--spare-slots" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=re.escape("TRAINGUARD_SPARE_SLOTS='two' must be a whole number >= 0")):
        launch(["--nproc-per-node", "2", "train.py"])


def test_spare_slots_given_in_code_or_by_the_flag_are_checked_too():
    with pytest.raises(ConfigError, match=re.escape("spare slots (--spare-slots, TRAINGUARD_SPARE_SLOTS) must be "
                                                    ">= 0, got -1")):
        dataclasses.replace(LaunchConfig(), spare_slots=-1)


def _agent(launch: LaunchConfig, strategies: str = "recover-in-place,exit"):
    """A node agent as ``trainguard run`` builds one (one restart allowed)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from trainguard.launcher.agent import TrainguardAgent

    class Rendezvous:
        def get_run_id(self) -> str:
            return "run"

    spec = WorkerSpec(role="worker", local_world_size=1, rdzv_handler=Rendezvous(), entrypoint="train.py",
                      max_restarts=1)
    return TrainguardAgent(spec=spec, logs_specs=DefaultLogsSpecs(), launch=launch, secret="s" * 20,
                           controller_config=ControllerConfig(strategies=strategies))


def test_the_node_agent_takes_standby_spare_slots_and_the_snapshot_root_from_the_launcher(clean_env, tmp_path):
    from types import SimpleNamespace

    assert _agent(LaunchConfig())._wants_standby()
    assert not _agent(LaunchConfig(standby=False))._wants_standby()
    assert not _agent(LaunchConfig(), strategies="recover,exit")._wants_standby()  # no spare slot to fill
    assert _agent(LaunchConfig(spare_slots=1), strategies="recover,exit")._wants_standby()
    clean_env.setenv("TRAINGUARD_SNAPSHOT_ROOT", "/nonexistent")  # not read: the agent was handed its root
    clean_env.setenv("TRAINGUARD_SNAPSHOT_DIR", "")  # the agent sets it for its workers: undone after the test
    agent = _agent(LaunchConfig(snapshot_root=str(tmp_path)))
    agent.node.snapshots(SimpleNamespace(group_world_size=1, group_rank=0), store=None, round_key="")
    try:
        assert agent.snapshot_dir.path.parent == tmp_path
        assert os.environ["TRAINGUARD_SNAPSHOT_DIR"] == str(agent.snapshot_dir.path)  # handed on to the workers
    finally:
        agent.snapshot_dir.remove()


class _Manager:  # the parts of msrun's _ProcessManager that MsrunPlugin reads before starting anything
    worker_num, local_worker_num, master_port = 2, 2, 10970


@pytest.fixture
def msrun(clean_env):
    from trainguard.launcher import msrun

    clean_env.setenv("TRAINGUARD_STRATEGIES", "dump,exit")  # no pod annotations file consulted
    clean_env.setenv("PATH", os.environ["PATH"])  # attach puts the interpreter's directory first
    clean_env.setitem(sys.modules, _Manager.__module__, type(sys)("fake"))  # attach patches its subprocess
    return msrun


def test_msrun_reads_the_launcher_s_settings_when_it_attaches(msrun, clean_env, tmp_path):
    clean_env.setenv("TRAINGUARD_JOB_ID", "ms-7")
    clean_env.setenv("TRAINGUARD_SNAPSHOT_ROOT", str(tmp_path))
    clean_env.setenv("TRAINGUARD_FAULT", "crash:rank=1,step=2")
    manager = _Manager()
    assert msrun.attach(manager)
    plugin = manager.handler
    assert plugin.config.job_id == "ms-7"
    assert plugin.launch == LaunchConfig(faults=tuple(FaultSpec.parse("crash:rank=1,step=2")), job_id="ms-7",
                                         snapshot_root=str(tmp_path))


@pytest.mark.parametrize("env, message", [
    ({"TRAINGUARD_STANDBY": "maybe"}, "TRAINGUARD_STANDBY='maybe': use on or off"),
    ({"TRAINGUARD_FAULT": "crash:step=1"}, "TRAINGUARD_FAULT: bad fault 'crash:step=1'"),
    ({"TRAINGUARD_PRELOCK_TIMEOUT_S": "soon"}, "TRAINGUARD_PRELOCK_TIMEOUT_S='soon' is not a valid float"),
])
def test_msrun_refuses_a_bad_setting_before_any_worker(msrun, clean_env, capsys, env, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    manager = _Manager()
    with pytest.raises(SystemExit) as e:
        msrun.attach(manager)
    assert e.value.code == 2 and f"trainguard msrun: {message}" in capsys.readouterr().err
    assert not hasattr(manager, "handler")


# ------------------------------------------------------------ the CLI
def _status(env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "status", "--controller", "127.0.0.1:9"],
                          capture_output=True, text=True, env=full, timeout=60)


def test_status_takes_the_secret_from_the_secret_s_reader_and_names_a_bad_one(tmp_path):
    out = _status({"TRAINGUARD_TOKEN_FILE": str(tmp_path / "missing")})
    assert out.returncode == 2 and "cannot read the job secret from TRAINGUARD_TOKEN_FILE=" in out.stderr
    assert "Traceback" not in out.stderr
    assert "give --controller and the job secret" in _status({}).stderr
    out = _status({"TRAINGUARD_TOKEN": "t" * 32})  # accepted: the controller (none there) is asked
    assert out.returncode == 1 and out.stderr.startswith("trainguard status: "), out.stderr
