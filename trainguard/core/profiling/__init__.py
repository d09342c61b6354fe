"""Lightweight per-rank profiling and slow-node detection (TaskD's capability).

* :mod:`.switch` -- the run-time JSON switch file;
* :mod:`.recorder` -- buffers a rank's spans and writes them as NDJSON;
* :mod:`.files` -- the on-disk layout, new files and ageing;
* :mod:`.records` -- reading records back into per-step rows;
* :mod:`.detect` -- cross-rank and time-series detection;
* :mod:`.report` -- ``trainguard slow-nodes``: table, JSON and plot;
* :mod:`.live` -- the same detection while the job runs.
"""

from .detect import Detector, DetectorConfig, Finding
from .recorder import MARKERS, ProfilingConfig, Recorder, job_id_from_env, recorder_from_env
from .switch import OFF, Switch, SwitchFile, parse_switch

__all__ = [
    "Detector", "DetectorConfig", "Finding", "MARKERS", "OFF", "ProfilingConfig", "Recorder", "Switch",
    "SwitchFile", "job_id_from_env", "parse_switch", "recorder_from_env",
]
