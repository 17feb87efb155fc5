"""Averaging: DHT matchmaking and an all-or-nothing butterfly all-reduce over authenticated TCP (``GroupAverager``).

Everything but ``AveragingConfig`` is imported lazily (PEP 562), so that ``hivetrain.config`` (which needs
``AveragingConfig``) pulls in neither torch nor hivemind: a command's ``--help`` and config errors answer at once.
"""

from typing import Any

from hivetrain.averaging.config import AveragingConfig

__all__ = ["Averager", "AveragingConfig", "GroupAverager", "RoundFailed", "RoundResult"]

_LAZY = {
    "Averager": "hivetrain.averaging.base",
    "RoundFailed": "hivetrain.averaging.base",
    "RoundResult": "hivetrain.averaging.base",
    "GroupAverager": "hivetrain.averaging.engine",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hivetrain.averaging' has no attribute {name!r}")
