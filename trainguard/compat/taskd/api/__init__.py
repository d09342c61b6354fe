"""``taskd.api`` under trainguard: the manager's and the worker's calls.

TaskD's proxy and agent calls (``init_taskd_proxy``, ``init_taskd_agent``,
``register_func``) are not provided: ``trainguard run``'s relay and elastic
agent do their jobs.
"""

from .taskd_manager_api import init_taskd_manager, start_taskd_manager
from .taskd_worker_api import destroy_taskd_worker, init_taskd_worker, start_taskd_worker

__all__ = ["destroy_taskd_worker", "init_taskd_manager", "init_taskd_worker", "start_taskd_manager",
           "start_taskd_worker"]
