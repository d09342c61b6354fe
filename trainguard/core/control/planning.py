"""Choosing an episode's plan, its second stage, once every live rank stopped.

:func:`next_plan` wraps :func:`~trainguard.core.control.decide.decide` with what an
episode adds to it: scaling back up (the ranks elastic training dropped
rejoin) when a plan for that was made, and going on as before when scaling
back up was abandoned. :data:`STATE_OF` is the controller's state while a
plan of each strategy is carried out.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from ..api import ControllerState, Plan, RankState, Strategy
from ..config import ControllerConfig
from .decide import Agents, decide
from .episode import Episode
from ..replicas import Layout

__all__ = ["STATE_OF", "next_plan"]

#: The controller's state while a plan is carried out (any other strategy: EXITED).
STATE_OF = {Strategy.RETRY: ControllerState.RECOVERING, Strategy.RECOVER_IN_PLACE: ControllerState.RECOVERING,
            Strategy.RECOVER: ControllerState.RECOVERING, Strategy.ELASTIC_TRAINING: ControllerState.RECOVERING,
            Strategy.DUMP: ControllerState.DUMPING}


def next_plan(ep: Episode, grow_plan: Plan | None, view: Mapping[int, RankState],
              layout: Layout, config: ControllerConfig, wall: Callable[[], float],
              agents: Callable[[], Agents], missing: Callable[[], set[int]],
              previous: tuple[int, str] | None = None) -> tuple[Plan, str]:
    """The plan for the episode, and why.

    Args:
        ep: the episode, its faults and the strategies it tried.
        grow_plan: the plan that takes the dropped ranks back in, when one was made.
        view: what is known of each rank.
        layout: each rank's replica groups.
        config: the strategies allowed, in order.
        wall: unix seconds.
        agents: the node agents' view (asked only when needed).
        missing: the ranks that never registered (asked only when needed).
        previous: ``(step, cause)`` of the dying gasp the job resumed from, if any.
    """
    if grow_plan is not None:
        return grow_plan, f"scaling back up at step {grow_plan.step}: ranks {sorted(grow_plan.replacements)[:16]} rejoin"
    if ep.grow:  # go on as before
        plan, reason = decide(view, [], dataclasses.replace(config, strategies=(Strategy.RETRY,)),
                              wall(), layout=layout, tried=ep.tried)
        return plan, f"scaling back up abandoned; {reason}"
    return decide(view, ep.faults, config, wall(), layout=layout, tried=ep.tried,
                  agents=agents(), missing=missing(), previous=previous)
