"""The ``msrun`` target: let trainguard own the workers that plain ``msrun`` starts.

Both the ``msrun`` console script and ``python -m mindspore.parallel.cluster.run``
build a ``_ProcessManager`` from
``mindspore/parallel/cluster/process_entity/_api.py``. Its constructor calls::

    def _check_taskd(self):
        \"\"\"check if enable taskd.\"\"\"
        self.handler = RSCPluginHandle()
        self.enable_mindx = self.handler.check_enable()
        ...

which is MindSpore's own hook for an outside process controller (MindX
taskd): when ``enable_mindx`` ends up true, ``run()`` starts the scheduler as
usual and then calls ``self.handler.start()`` instead of starting and joining
the workers itself, and the controller drives the workers through the
callbacks ``_check_taskd`` registers (``KILL_WORKER``, ``START_ALL_WORKER``,
``START_WORKER_LIST``, ``MONITOR``). The block goes first in its body and
hands the manager to :func:`trainguard.launcher.msrun.attach`, which takes
that same place: it sets ``self.handler`` and ``self.enable_mindx = True`` and
returns True, and the block returns before taskd is looked for. When
``attach`` returns False, ``TRAINGUARD_DISABLE=1`` is set (taken out of the
environment so the workers never see it), or trainguard is missing from the
environment, MindSpore's own code runs on: taskd if it is configured, else
plain msrun.
"""

from .core import Target, handing_over

__all__ = ["TARGET"]

TARGET = Target(
    name="msrun",
    summary="make plain `msrun` (and `python -m mindspore.parallel.cluster.run`) hand its workers to trainguard",
    package="mindspore",
    distribution="mindspore",
    relative_path="parallel/cluster/process_entity/_api.py",
    min_version=(2, 10),
    max_version=(2, 11),
    anchor='        """check if enable taskd."""',
    body=handing_over("msrun", "trainguard.launcher.msrun import attach as _tg_attach",
                      "if _tg_attach(self):\n    return"),
)
