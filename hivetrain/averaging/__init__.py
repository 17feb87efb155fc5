"""Averaging: DHT matchmaking and an all-or-nothing butterfly all-reduce over authenticated TCP (``GroupAverager``).

``GroupAverager`` is imported lazily, so that ``hivetrain.config`` (which needs ``AveragingConfig``) does not pull in
hivemind and the networking stack.
"""

from typing import Any

from hivetrain.averaging.base import Averager, RoundFailed, RoundResult
from hivetrain.averaging.config import AveragingConfig

__all__ = ["Averager", "AveragingConfig", "GroupAverager", "RoundFailed", "RoundResult"]


def __getattr__(name: str) -> Any:
    if name == "GroupAverager":
        from hivetrain.averaging.engine import GroupAverager

        return GroupAverager
    raise AttributeError(f"module 'hivetrain.averaging' has no attribute {name!r}")
