"""The ``torchrun`` target: route plain ``torchrun`` through ``trainguard run``.

torch's ``torch/distributed/run.py`` ends with::

    def run(args):
        ...

    @record
    def main(args=None):
        args = parse_args(args)
        run(args)

Both the ``torchrun`` console script and ``python -m torch.distributed.run``
call ``main``; ``accelerate launch`` (and ``python -m
torch.distributed.launch``) build the arguments themselves and call ``run``.
So there are two blocks: the first goes first in ``main``'s body and hands the
same arguments to :func:`trainguard.launcher.run.main`, which parses
torchrun's flags (and trainguard's) with torch's own parser; the second goes
first in ``run``'s body and hands the parsed arguments to
:func:`trainguard.launcher.run.main_namespace`. ``TRAINGUARD_DISABLE=1``
(taken out of the environment so the workers never see it) or trainguard
missing from the environment leaves plain torchrun, for ``run`` too when
``main`` called it.
"""

from .core import Target, handing_over

__all__ = ["TARGET"]

_PLAIN = '_TRAINGUARD_PLAIN'

TARGET = Target(
    name="torchrun",
    summary="make plain `torchrun`, `python -m torch.distributed.run` and `accelerate launch` launch through "
            "`trainguard run`",
    package="torch",
    distribution="torch",
    relative_path="distributed/run.py",
    min_version=(2, 4),
    max_version=(2, 14),
    anchor="def main(args=None):",
    body=handing_over("torchrun", "trainguard.launcher.run import main as _tg_main",
                      "sys.exit(_tg_main(sys.argv[1:] if args is None else list(args)))")
    + f"\nglobals()[{_PLAIN!r}] = True  # plain torchrun: its run() stays plain too",
    more=(("def run(args):",
           handing_over("torchrun", "trainguard.launcher.run import main_namespace as _tg_run",
                        "sys.exit(_tg_run(args))",
                        unless=f"globals().get({_PLAIN!r})")),),
)
