"""The per-process TTP session, under the name scripts import it by
(``from trainguard.compat.mindio_ttp.state import TTP``); it lives in
:mod:`trainguard.adapters.megatron.session`."""

from trainguard.adapters.megatron.session import TTP, TtpSession, _State, checked_int

__all__ = ["TTP", "TtpSession", "_State", "checked_int"]  # _State: the class's former name
