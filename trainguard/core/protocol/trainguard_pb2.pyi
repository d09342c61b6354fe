from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_STATUS_UNSPECIFIED: _ClassVar[DataStatus]
    UPDATED: _ClassVar[DataStatus]
    UPDATING: _ClassVar[DataStatus]
    COPYING: _ClassVar[DataStatus]

class RunStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATUS_UNSPECIFIED: _ClassVar[RunStatus]
    STARTING: _ClassVar[RunStatus]
    TRAINING: _ClassVar[RunStatus]
    STOPPED: _ClassVar[RunStatus]
    RECOVERING: _ClassVar[RunStatus]
    EXITING: _ClassVar[RunStatus]
    FINISHED: _ClassVar[RunStatus]

class FaultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAULT_KIND_UNSPECIFIED: _ClassVar[FaultKind]
    UCE: _ClassVar[FaultKind]
    COMM: _ClassVar[FaultKind]
    PROCESS_LOST: _ClassVar[FaultKind]
    HANG: _ClassVar[FaultKind]
    UNKNOWN: _ClassVar[FaultKind]

class Severity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEVERITY_UNSPECIFIED: _ClassVar[Severity]
    LOW: _ClassVar[Severity]
    HIGH: _ClassVar[Severity]
    CORRUPTED: _ClassVar[Severity]
DATA_STATUS_UNSPECIFIED: DataStatus
UPDATED: DataStatus
UPDATING: DataStatus
COPYING: DataStatus
RUN_STATUS_UNSPECIFIED: RunStatus
STARTING: RunStatus
TRAINING: RunStatus
STOPPED: RunStatus
RECOVERING: RunStatus
EXITING: RunStatus
FINISHED: RunStatus
FAULT_KIND_UNSPECIFIED: FaultKind
UCE: FaultKind
COMM: FaultKind
PROCESS_LOST: FaultKind
HANG: FaultKind
UNKNOWN: FaultKind
SEVERITY_UNSPECIFIED: Severity
LOW: Severity
HIGH: Severity
CORRUPTED: Severity

class Challenge(_message.Message):
    __slots__ = ("nonce", "dialed")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DIALED_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    dialed: str
    def __init__(self, nonce: _Optional[bytes] = ..., dialed: _Optional[str] = ...) -> None: ...

class ChallengeAnswer(_message.Message):
    __slots__ = ("nonce", "proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class ReplicaGroup(_message.Message):
    __slots__ = ("rank_list", "replica_cnt", "replica_shift", "range_start", "range_step", "range_count")
    RANK_LIST_FIELD_NUMBER: _ClassVar[int]
    REPLICA_CNT_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SHIFT_FIELD_NUMBER: _ClassVar[int]
    RANGE_START_FIELD_NUMBER: _ClassVar[int]
    RANGE_STEP_FIELD_NUMBER: _ClassVar[int]
    RANGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    rank_list: _containers.RepeatedScalarFieldContainer[int]
    replica_cnt: int
    replica_shift: int
    range_start: int
    range_step: int
    range_count: int
    def __init__(self, rank_list: _Optional[_Iterable[int]] = ..., replica_cnt: _Optional[int] = ..., replica_shift: _Optional[int] = ..., range_start: _Optional[int] = ..., range_step: _Optional[int] = ..., range_count: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("step", "run", "data", "step_time_s", "silence_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SILENCE_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    run: RunStatus
    data: DataStatus
    step_time_s: float
    silence_s: float
    def __init__(self, step: _Optional[int] = ..., run: _Optional[_Union[RunStatus, str]] = ..., data: _Optional[_Union[DataStatus, str]] = ..., step_time_s: _Optional[float] = ..., silence_s: _Optional[float] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("rank", "world_size", "pid", "host", "status", "replicas", "device", "device_repairable", "restart_count", "joining", "resumed_after_dump", "join_refused")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_REPAIRABLE_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AFTER_DUMP_FIELD_NUMBER: _ClassVar[int]
    JOIN_REFUSED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    pid: int
    host: str
    status: Status
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaGroup]
    device: str
    device_repairable: bool
    restart_count: int
    joining: bool
    resumed_after_dump: str
    join_refused: str
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., host: _Optional[str] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaGroup, _Mapping]]] = ..., device: _Optional[str] = ..., device_repairable: _Optional[bool] = ..., restart_count: _Optional[int] = ..., joining: _Optional[bool] = ..., resumed_after_dump: _Optional[str] = ..., join_refused: _Optional[str] = ...) -> None: ...

class FaultReport(_message.Message):
    __slots__ = ("kind", "severity", "phase", "message", "occurred_at", "status")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OCCURRED_AT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    kind: FaultKind
    severity: Severity
    phase: str
    message: str
    occurred_at: float
    status: Status
    def __init__(self, kind: _Optional[_Union[FaultKind, str]] = ..., severity: _Optional[_Union[Severity, str]] = ..., phase: _Optional[str] = ..., message: _Optional[str] = ..., occurred_at: _Optional[float] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("name", "bytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    bytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("command_id", "ok", "code", "message", "status", "shards", "own")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    ok: bool
    code: int
    message: str
    status: Status
    shards: _containers.RepeatedCompositeFieldContainer[ShardFiles]
    own: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, command_id: _Optional[int] = ..., ok: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., shards: _Optional[_Iterable[_Union[ShardFiles, _Mapping]]] = ..., own: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: Status
    def __init__(self, status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class PersistHealth(_message.Message):
    __slots__ = ("failing", "since_step", "reason", "last_complete")
    FAILING_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    failing: bool
    since_step: int
    reason: str
    last_complete: int
    def __init__(self, failing: _Optional[bool] = ..., since_step: _Optional[int] = ..., reason: _Optional[str] = ..., last_complete: _Optional[int] = ...) -> None: ...

class RankMessage(_message.Message):
    __slots__ = ("hello", "heartbeat", "stopped", "fault", "result", "goodbye", "persist")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    FAULT_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Status
    stopped: Status
    fault: FaultReport
    result: CommandResult
    goodbye: Goodbye
    persist: PersistHealth
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Status, _Mapping]] = ..., stopped: _Optional[_Union[Status, _Mapping]] = ..., fault: _Optional[_Union[FaultReport, _Mapping]] = ..., result: _Optional[_Union[CommandResult, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., persist: _Optional[_Union[PersistHealth, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("job_id", "heartbeat_interval_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    heartbeat_interval_s: float
    def __init__(self, job_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ("reason", "at_boundary")
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    reason: str
    at_boundary: bool
    def __init__(self, reason: _Optional[str] = ..., at_boundary: _Optional[bool] = ...) -> None: ...

class Clean(_message.Message):
    __slots__ = ("uce",)
    UCE_FIELD_NUMBER: _ClassVar[int]
    uce: bool
    def __init__(self, uce: _Optional[bool] = ...) -> None: ...

class Rebuild(_message.Message):
    __slots__ = ("generation", "excluded", "join_store")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    JOIN_STORE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    excluded: _containers.RepeatedScalarFieldContainer[int]
    join_store: str
    def __init__(self, generation: _Optional[int] = ..., excluded: _Optional[_Iterable[int]] = ..., join_store: _Optional[str] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("src", "dst", "kind")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    kind: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ..., kind: _Optional[int] = ...) -> None: ...

class Repair(_message.Message):
    __slots__ = ("step", "transfers")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    step: int
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    def __init__(self, step: _Optional[int] = ..., transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ...) -> None: ...

class Rollback(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class Save(_message.Message):
    __slots__ = ("step", "kinds", "carry")
    STEP_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    CARRY_FIELD_NUMBER: _ClassVar[int]
    step: int
    kinds: _containers.RepeatedScalarFieldContainer[int]
    carry: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., kinds: _Optional[_Iterable[int]] = ..., carry: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardFiles(_message.Message):
    __slots__ = ("kind", "copies", "full", "rank", "files")
    KIND_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    kind: int
    copies: _containers.RepeatedScalarFieldContainer[int]
    full: bool
    rank: int
    files: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, kind: _Optional[int] = ..., copies: _Optional[_Iterable[int]] = ..., full: _Optional[bool] = ..., rank: _Optional[int] = ..., files: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class Finalize(_message.Message):
    __slots__ = ("step", "shards", "history_json", "own")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_JSON_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    step: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardFiles]
    history_json: str
    own: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, step: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardFiles, _Mapping]]] = ..., history_json: _Optional[str] = ..., own: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("step", "record_json", "pids_json", "replicas")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RECORD_JSON_FIELD_NUMBER: _ClassVar[int]
    PIDS_JSON_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    step: int
    record_json: str
    pids_json: str
    replicas: int
    def __init__(self, step: _Optional[int] = ..., record_json: _Optional[str] = ..., pids_json: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class Exit(_message.Message):
    __slots__ = ("code", "reason")
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "epoch", "stop", "clean", "rebuild", "repair", "rollback", "save", "finalize", "resume", "exit")
    ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    REBUILD_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    FINALIZE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    id: int
    epoch: int
    stop: Stop
    clean: Clean
    rebuild: Rebuild
    repair: Repair
    rollback: Rollback
    save: Save
    finalize: Finalize
    resume: Resume
    exit: Exit
    def __init__(self, id: _Optional[int] = ..., epoch: _Optional[int] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., clean: _Optional[_Union[Clean, _Mapping]] = ..., rebuild: _Optional[_Union[Rebuild, _Mapping]] = ..., repair: _Optional[_Union[Repair, _Mapping]] = ..., rollback: _Optional[_Union[Rollback, _Mapping]] = ..., save: _Optional[_Union[Save, _Mapping]] = ..., finalize: _Optional[_Union[Finalize, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., exit: _Optional[_Union[Exit, _Mapping]] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("welcome", "command")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    command: Command
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ...) -> None: ...

class ProcessExit(_message.Message):
    __slots__ = ("rank", "pid", "exit_code", "reason", "last_running")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_RUNNING_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    exit_code: int
    reason: str
    last_running: float
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., last_running: _Optional[float] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "state", "json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: str
    json: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...

class RankEnvelope(_message.Message):
    __slots__ = ("rank", "message", "disconnected")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DISCONNECTED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    message: RankMessage
    disconnected: bool
    def __init__(self, rank: _Optional[int] = ..., message: _Optional[_Union[RankMessage, _Mapping]] = ..., disconnected: _Optional[bool] = ...) -> None: ...

class AgentHello(_message.Message):
    __slots__ = ("ranks", "spare", "key", "probe")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    spare: int
    key: bytes
    probe: str
    def __init__(self, ranks: _Optional[_Iterable[int]] = ..., spare: _Optional[int] = ..., key: _Optional[bytes] = ..., probe: _Optional[str] = ...) -> None: ...

class AgentEvent(_message.Message):
    __slots__ = ("rank", "order", "ok", "pid", "join_store", "message", "rates")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    JOIN_STORE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RATES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    order: int
    ok: bool
    pid: int
    join_store: str
    message: str
    rates: _containers.RepeatedCompositeFieldContainer[LinkRate]
    def __init__(self, rank: _Optional[int] = ..., order: _Optional[int] = ..., ok: _Optional[bool] = ..., pid: _Optional[int] = ..., join_store: _Optional[str] = ..., message: _Optional[str] = ..., rates: _Optional[_Iterable[_Union[LinkRate, _Mapping]]] = ...) -> None: ...

class LinkRate(_message.Message):
    __slots__ = ("node", "bytes_per_s", "error")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    node: str
    bytes_per_s: float
    error: str
    def __init__(self, node: _Optional[str] = ..., bytes_per_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class NodeMessage(_message.Message):
    __slots__ = ("node", "items", "agent", "events", "exits")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    EXITS_FIELD_NUMBER: _ClassVar[int]
    node: str
    items: _containers.RepeatedCompositeFieldContainer[RankEnvelope]
    agent: AgentHello
    events: _containers.RepeatedCompositeFieldContainer[AgentEvent]
    exits: _containers.RepeatedCompositeFieldContainer[ProcessExit]
    def __init__(self, node: _Optional[str] = ..., items: _Optional[_Iterable[_Union[RankEnvelope, _Mapping]]] = ..., agent: _Optional[_Union[AgentHello, _Mapping]] = ..., events: _Optional[_Iterable[_Union[AgentEvent, _Mapping]]] = ..., exits: _Optional[_Iterable[_Union[ProcessExit, _Mapping]]] = ...) -> None: ...

class NodeDelivery(_message.Message):
    __slots__ = ("ranks", "message", "refused")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    message: ControllerMessage
    refused: str
    def __init__(self, ranks: _Optional[_Iterable[int]] = ..., message: _Optional[_Union[ControllerMessage, _Mapping]] = ..., refused: _Optional[str] = ...) -> None: ...

class AgentOrder(_message.Message):
    __slots__ = ("id", "start", "kill", "restarts_left", "moved", "dropped", "probe")
    ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    KILL_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_LEFT_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    id: int
    start: StartReplacement
    kill: int
    restarts_left: int
    moved: int
    dropped: int
    probe: LinkProbe
    def __init__(self, id: _Optional[int] = ..., start: _Optional[_Union[StartReplacement, _Mapping]] = ..., kill: _Optional[int] = ..., restarts_left: _Optional[int] = ..., moved: _Optional[int] = ..., dropped: _Optional[int] = ..., probe: _Optional[_Union[LinkProbe, _Mapping]] = ...) -> None: ...

class LinkProbe(_message.Message):
    __slots__ = ("nodes", "addrs", "bytes")
    NODES_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    bytes: int
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., addrs: _Optional[_Iterable[str]] = ..., bytes: _Optional[int] = ...) -> None: ...

class StartReplacement(_message.Message):
    __slots__ = ("rank", "generation", "step", "join_store")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    JOIN_STORE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    generation: int
    step: int
    join_store: str
    def __init__(self, rank: _Optional[int] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., join_store: _Optional[str] = ...) -> None: ...

class NodeCommands(_message.Message):
    __slots__ = ("items", "orders")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ORDERS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[NodeDelivery]
    orders: _containers.RepeatedCompositeFieldContainer[AgentOrder]
    def __init__(self, items: _Optional[_Iterable[_Union[NodeDelivery, _Mapping]]] = ..., orders: _Optional[_Iterable[_Union[AgentOrder, _Mapping]]] = ...) -> None: ...
