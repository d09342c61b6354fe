"""trainguard for the trainers users run: HF Trainer (:mod:`.hf`), Lightning
(:mod:`.lightning`) and accelerate loops (:mod:`.accelerate`).

Each drives the torch Guard through its step API (``begin_step``,
``end_step``, ``fail_step``; :class:`trainguard.core.rank.contract.Guard`)
from the hooks its framework offers. Each imports its framework, so import
the one you use (``pip install 'trainguard[hf]'``, ``[lightning]``,
``[accelerate]``).
"""
