"""trainguard's framework-free core: control plane, decisions, checkpoints, faults.

Nothing under :mod:`trainguard.core` imports torch, MindSpore or Megatron;
adapters build on the names exported here.
"""

from . import forks

forks.install()  # before gRPC is imported: it reads GRPC_ENABLE_FORK_SUPPORT then

from .api import (
    EXIT_AFTER_DUMP,
    EXIT_UNRECOVERABLE,
    EXIT_HUNG,
    CheckpointError,
    ConfigError,
    ControllerLostError,
    ControllerState,
    DataStatus,
    Fault,
    FaultKind,
    ForceStop,
    Plan,
    ProtocolError,
    RankState,
    RecoveryError,
    ResumeError,
    RunStatus,
    Severity,
    Strategy,
    Transfer,
    TrainguardError,
    TransitionError,
)
from .checkpoint import MEGATRON, MINDSPORE, TORCH, CheckpointStore, FileInfo
from .classify import Classifier
from .config import ControllerConfig, ProcessorConfig, RankConfig, check_env, parse_strategies
from .control.decide import decide
from .faults import FaultInjector, FaultSpec
from .rank.processor import Processor
from .rank.recovery import Handlers, Outcome, recover, report_left_step
from .replicas import ReplicaGroup, choose_savers, choose_sources
from .control.server import Controller

__all__ = [
    "EXIT_AFTER_DUMP", "EXIT_HUNG", "EXIT_UNRECOVERABLE", "CheckpointError", "CheckpointStore", "Classifier", "ConfigError",
    "Controller", "ControllerConfig", "ControllerLostError", "ControllerState", "DataStatus", "Fault",
    "FaultInjector", "FaultKind", "FaultSpec", "FileInfo", "ForceStop", "Handlers", "MEGATRON", "MINDSPORE", "Outcome",
    "Plan", "Processor", "ProcessorConfig", "ProtocolError", "RankConfig", "RankState", "RecoveryError", "ReplicaGroup", "ResumeError",
    "RunStatus", "Severity", "Strategy", "TORCH", "Transfer", "TrainguardError", "TransitionError",
    "check_env", "choose_savers", "choose_sources", "decide", "parse_strategies", "recover", "report_left_step",
]
