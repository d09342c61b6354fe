"""Drop-in names from Huawei's Ascend fault-tolerance stack, run on trainguard.

A script written for MindCluster TaskD keeps its calls and changes only the
import prefix (``taskd.`` becomes ``trainguard.compat.taskd.``)::

    from taskd.api import init_taskd_manager, start_taskd_manager             # TaskD
    from trainguard.compat.taskd.api import init_taskd_manager, start_taskd_manager

    from taskd.api.taskd_worker_api import init_taskd_worker, start_taskd_worker
    from trainguard.compat.taskd.api.taskd_worker_api import init_taskd_worker, start_taskd_worker

The same names are importable from :mod:`trainguard.compat` itself. What
each one does in trainguard is listed in :mod:`trainguard.compat.taskd`.
MindIO's ``ttp_*`` / ``tft_*`` names are in :mod:`trainguard.compat.mindio_ttp`
(``mindio_ttp.framework_ttp`` becomes ``trainguard.compat.mindio_ttp.framework_ttp``).
"""

from .taskd.api import (
    destroy_taskd_worker,
    init_taskd_manager,
    init_taskd_worker,
    start_taskd_manager,
    start_taskd_worker,
)

__all__ = ["destroy_taskd_worker", "init_taskd_manager", "init_taskd_worker", "start_taskd_manager",
           "start_taskd_worker"]
