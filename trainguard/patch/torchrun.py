"""The ``torchrun`` target: route plain ``torchrun`` through ``trainguard run``.

torch's ``torch/distributed/run.py`` ends with::

    @record
    def main(args=None):
        args = parse_args(args)
        run(args)

Both the ``torchrun`` console script and ``python -m torch.distributed.run``
call it. The block goes first in its body and hands the same arguments to
:func:`trainguard.launcher.run.main`, which parses torchrun's flags with
torch's own parser. ``TRAINGUARD_DISABLE=1`` (taken out of the environment
so the workers never see it) or trainguard missing from the environment
leaves plain torchrun. ``python -m torch.distributed.launch`` calls ``run()``
directly and is not rerouted.
"""

from .core import Target, handing_over

__all__ = ["TARGET"]

TARGET = Target(
    name="torchrun",
    summary="make plain `torchrun` (and `python -m torch.distributed.run`) launch through `trainguard run`",
    package="torch",
    distribution="torch",
    relative_path="distributed/run.py",
    min_version=(2, 4),
    max_version=(2, 14),
    anchor="def main(args=None):",
    body=handing_over("torchrun", "trainguard.launcher.run import main as _tg_main",
                      "sys.exit(_tg_main(sys.argv[1:] if args is None else list(args)))"),
)
