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

from .core import Target

__all__ = ["TARGET"]

BODY = """\
import os, sys
if os.environ.pop("TRAINGUARD_DISABLE", "") in ("", "0"):
    try:
        from trainguard.launcher.run import main as _tg_main
    except ImportError as _tg_error:
        print(f"trainguard: cannot import trainguard ({_tg_error}); running plain torchrun "
              f"(undo the patch with `adapters-patch torchrun --revert`)", file=sys.stderr)
    else:
        sys.exit(_tg_main(sys.argv[1:] if args is None else list(args)))"""

TARGET = Target(
    name="torchrun",
    summary="make plain `torchrun` (and `python -m torch.distributed.run`) launch through `trainguard run`",
    package="torch",
    distribution="torch",
    relative_path="distributed/run.py",
    min_version=(2, 4),
    max_version=(2, 14),
    anchor="def main(args=None):",
    body=BODY,
)
