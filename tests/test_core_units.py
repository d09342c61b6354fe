"""Small core pieces: state transitions, config, fault specs, classification."""

import json
import os

import pytest

from trainguard.core import (
    ConfigError,
    ControllerConfig,
    DataStatus,
    FaultInjector,
    FaultKind,
    FaultSpec,
    RunStatus,
    Severity,
    Strategy,
    TransitionError,
    check_env,
    parse_strategies,
)
from trainguard.core.classify import Classifier
from trainguard.core.transitions import advance


# ------------------------------------------------------------- transitions
def test_update_window_transitions():
    s = advance(DataStatus.UPDATED, DataStatus.UPDATING)
    s = advance(s, DataStatus.UPDATED)
    assert s is DataStatus.UPDATED
    assert advance(DataStatus.UPDATING, DataStatus.COPYING) is DataStatus.COPYING


def test_illegal_transitions_are_named_errors():
    with pytest.raises(TransitionError, match="rank 3: illegal DataStatus transition UPDATING -> UPDATING"):
        advance(DataStatus.UPDATING, DataStatus.UPDATING, what="rank 3")
    with pytest.raises(TransitionError):
        advance(RunStatus.FINISHED, RunStatus.TRAINING)


# ------------------------------------------------------------- config
def test_strategies_parse_and_refuse_bad_lists():
    assert parse_strategies("retry, dump,exit") == (Strategy.RETRY, Strategy.DUMP, Strategy.EXIT)
    with pytest.raises(ConfigError, match="unknown recover strategy 'retyr'"):
        parse_strategies("retyr,dump")
    with pytest.raises(ConfigError, match="listed twice"):
        parse_strategies("dump,dump")
    with pytest.raises(ConfigError, match="empty"):
        parse_strategies(" , ")


def test_unknown_environment_variable_is_an_error_with_a_suggestion():
    with pytest.raises(ConfigError, match="TRAINGUARD_STRATEGY; did you mean TRAINGUARD_STRATEGIES"):
        check_env({"TRAINGUARD_STRATEGY": "dump"})


def test_controller_config_from_env_and_overrides():
    env = {"TRAINGUARD_STRATEGIES": "dump,exit", "TRAINGUARD_PRELOCK_TIMEOUT_S": "5", "TRAINGUARD_PORT": "0"}
    cfg = ControllerConfig.from_env(env, host="0.0.0.0")
    assert cfg.strategies == (Strategy.DUMP, Strategy.EXIT)
    assert cfg.prelock_timeout_s == 5.0 and cfg.host == "0.0.0.0"
    with pytest.raises(ConfigError, match="TRAINGUARD_PRELOCK_TIMEOUT_S='soon' is not a valid float"):
        ControllerConfig.from_env({"TRAINGUARD_PRELOCK_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="prelock_timeout_s must be > 0"):
        ControllerConfig(prelock_timeout_s=0)
    with pytest.raises(ConfigError, match="unknown controller settings"):
        ControllerConfig.from_env({}, prelock=3)


# ------------------------------------------------------------- faults
def test_fault_specs_parse():
    specs = FaultSpec.parse("uce:rank=1,step=5,phase=backward; crash:rank=2,step=9;slow:rank=0,step=3,factor=1.3")
    assert [(s.kind, s.rank, s.step, s.phase) for s in specs] == [
        ("uce", 1, 5, "backward"), ("crash", 2, 9, "forward"), ("slow", 0, 3, "forward")]
    assert specs[2].factor == 1.3
    assert FaultSpec.parse("uce:rank=0,step=1,severity=corrupted")[0].severity is Severity.CORRUPTED


@pytest.mark.parametrize("text, message", [
    ("boom:rank=1,step=2", "KIND in uce, crash, hang, freeze, stop, stall, comm, slow, pause"),
    ("pause:rank=1,step=2,phase=forward,factor=5", "pause needs phase=gc or phase=save"),
    ("hang:rank=1,step=2,phase=gc", "phase=gc is for pause only"),
    ("uce:rank=1", "missing step"),
    ("uce:rank=one,step=2", "must be integers"),
    ("uce:rank=1,step=2,phase=sideways", "phase must be one of"),
    ("uce:rank=1,step=2,when=now", "unknown or malformed item 'when=now'"),
    ("crash:rank=1,step=2,factor=2", "factor only applies to slow and pause"),
    ("slow:rank=1,step=2,factor=0.5", "slow needs factor >= 1"),
    ("uce 1 2", "expected KIND:rank=R,step=N"),
])
def test_malformed_fault_specs_are_clear_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        FaultSpec.parse(text)


def test_injector_strikes_once_and_records_it(tmp_path):
    log = tmp_path / "faults.jsonl"
    inj = FaultInjector(FaultSpec.parse("uce:rank=1,step=2,phase=backward"), rank=1, log_path=log)
    inj.strike("forward", 2)
    inj.strike("backward", 1)
    with pytest.raises(RuntimeError, match="UCE ERROR"):
        inj.strike("backward", 2)
    inj.strike("backward", 2)  # struck already: nothing happens
    entry = json.loads(log.read_text())
    assert entry["spec"] == "uce:rank=1,step=2,phase=backward" and entry["rank"] == 1
    # A relaunched job reads the log and does not strike again.
    again = FaultInjector(FaultSpec.parse("uce:rank=1,step=2,phase=backward"), rank=1, log_path=log)
    assert not again.armed


def test_injector_ignores_other_ranks_and_kills_and_slows():
    killed, slept = [], []
    inj = FaultInjector(FaultSpec.parse("crash:rank=0,step=1;slow:rank=0,step=2,factor=1.5;uce:rank=3,step=1"),
                        rank=0, kill=lambda pid, sig: killed.append(sig), sleep=slept.append)
    inj.strike("forward", 1)
    assert killed == [9]
    inj.after_step(2, 1.0)
    inj.after_step(3, 2.0)
    assert slept == [1.0]


# ------------------------------------------------------------- classification
@pytest.mark.parametrize("text, kind, severity", [
    ("UCE ERROR: device memory", FaultKind.UCE, Severity.HIGH),
    ("HCCL OP RETRY FAILED on link", FaultKind.COMM, Severity.HIGH),
    ("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234", FaultKind.COMM, Severity.HIGH),
    ("NCCL error in: ... unhandled system error", FaultKind.COMM, Severity.HIGH),
    ("CUDA error: uncorrectable ECC error encountered", FaultKind.UCE, Severity.HIGH),
    ("index out of range", FaultKind.UNKNOWN, Severity.HIGH),
])
def test_classification_by_message(text, kind, severity):
    verdict = Classifier().classify(RuntimeError(text))
    assert (verdict.kind, verdict.severity) == (kind, severity)


def test_ecc_inside_an_update_is_corrupted_and_stop_is_not_a_fault():
    c = Classifier()
    assert c.classify("HBM MULTI BIT ECC", in_update=True).severity is Severity.CORRUPTED
    assert c.classify("HBM MULTI BIT ECC", in_update=False).severity is Severity.HIGH
    assert c.classify("Got the following error ... FORCE STOP: stopped").is_stop


def test_injected_uce_carries_its_severity():
    for severity in Severity:
        inj = FaultInjector(FaultSpec.parse(f"uce:rank=0,step=1,severity={severity.name.lower()}"), rank=0)
        with pytest.raises(RuntimeError) as err:
            inj.strike("forward", 1)
        assert Classifier().classify(err.value).severity is severity


def test_user_patterns_come_first():
    c = Classifier()
    c.register(r"my fabric hiccup", FaultKind.COMM)
    assert c.classify(RuntimeError("my fabric hiccup in layer 3")).kind is FaultKind.COMM


def test_a_rank_s_settings_are_read_once_and_a_bad_value_is_refused_with_its_name():
    from trainguard.core.config import RankConfig

    assert RankConfig.from_env({}) == RankConfig()
    got = RankConfig.from_env({"TRAINGUARD_JOB_ID": "j1", "TRAINGUARD_SAVE_TIMEOUT_S": "60",
                               "TRAINGUARD_SNAPSHOT_DIR": "/dev/shm/x", "TRAINGUARD_SNAPSHOT_PEER": "h:1",
                               "TRAINGUARD_SNAPSHOT_OVERLAP": "0", "TRAINGUARD_SHM_REPAIR": "0",
                               "TORCHELASTIC_RESTART_COUNT": "2"})
    assert got == RankConfig(job_id="j1", save_timeout_s=60.0, node_dir="/dev/shm/x", snapshot_peer="h:1",
                             snapshot_overlap=False, shm_repair=False, restart_count=2)
    for env, message in [({"TRAINGUARD_SNAPSHOT_OVERLAP": "yes"}, "TRAINGUARD_SNAPSHOT_OVERLAP='yes'"),
                         ({"TRAINGUARD_SHM_REPAIR": "2"}, "TRAINGUARD_SHM_REPAIR='2'"),
                         ({"TRAINGUARD_SAVE_TIMEOUT_S": "0"}, "TRAINGUARD_SAVE_TIMEOUT_S='0' must be > 0"),
                         ({"TRAINGUARD_SAVE_TIMEOUT_S": "soon"}, "TRAINGUARD_SAVE_TIMEOUT_S='soon' is not a valid"),
                         ({"TRAINGUARD_SNAPSHOT_OVERLAPP": "1"}, "did you mean TRAINGUARD_SNAPSHOT_OVERLAP")]:
        with pytest.raises(ConfigError, match=message):
            RankConfig.from_env(env)


def test_the_snapshot_and_ttp_settings_of_a_rank_are_read_with_the_others():
    from trainguard.core.config import RankConfig

    got = RankConfig.from_env({"TRAINGUARD_SNAPSHOT_ROOT": "/tmp/shm", "TRAINGUARD_TOKEN": "s" * 20,
                               "TRAINGUARD_CHECKPOINT_DIR": "/ckpt", "TRAINGUARD_CONTROLLER": "h:2",
                               "TRAINGUARD_JOIN": '{"generation": 1, "step": 3}'})
    assert (got.snapshot_root, got.token, got.checkpoint_dir, got.controller, got.join) == \
        ("/tmp/shm", "s" * 20, "/ckpt", "h:2", '{"generation": 1, "step": 3}')
    assert "s" * 20 not in repr(got)  # the secret stays out of logs
    assert RankConfig.from_env({"TRAINGUARD_JOIN": ""}).join is None


def test_a_persist_worker_reads_its_trainer_and_secret_once():
    from trainguard.core.config import PersistConfig

    got = PersistConfig.from_env({"TRAINGUARD_PERSIST_PARENT": "42", "TRAINGUARD_TOKEN": "t" * 20,
                                  "TRAINGUARD_LOG_LEVEL": "DEBUG", "RANK": "3"})
    assert got == PersistConfig(parent_pid=42, token="t" * 20, log_level="DEBUG", rank="3")
    assert "t" * 20 not in repr(got)
    assert PersistConfig.from_env({}) == PersistConfig(parent_pid=os.getppid())
    with pytest.raises(ConfigError, match="TRAINGUARD_PERSIST_PARENT='me' is not a valid int"):
        PersistConfig.from_env({"TRAINGUARD_PERSIST_PARENT": "me"})
