"""Configuration of the averaging engine (a table ``[averaging]`` of the run's TOML file)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class AveragingConfig:
    """How pseudo-gradients are averaged across the peers of an epoch.

    Args:
        strategy: "butterfly" = one group of all ready peers (Moshpit SGD with a single group).
        target_group_size: the largest group matched for one all-reduce.
        min_group_size: rounds with fewer peers fail (1 = a lone peer applies its own pseudo-gradient).
        matchmaking_time_s: how long a peer waits for others to join its group, seconds.
        round_timeout_s: the whole round (matchmaking + all-reduce) must finish within this, seconds.
        max_retries: failed rounds retried before the peer falls back to a state download.
        max_samples_per_round: the largest weight (samples) a peer may claim for one round.
    """

    strategy: Literal["butterfly"] = "butterfly"
    target_group_size: int = Field(default=64, ge=1, le=4096)
    min_group_size: int = Field(default=1, ge=1)
    matchmaking_time_s: float = Field(default=5.0, gt=0.0, le=600.0)
    round_timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    max_retries: int = Field(default=2, ge=0, le=100)
    max_samples_per_round: int = Field(default=1_000_000, ge=1)

    def __post_init__(self) -> None:
        if self.min_group_size > self.target_group_size:
            raise ValueError(
                f"averaging.min_group_size ({self.min_group_size}) must not exceed "
                f"averaging.target_group_size ({self.target_group_size})"
            )
        if self.round_timeout_s <= self.matchmaking_time_s:
            raise ValueError(
                f"averaging.round_timeout_s ({self.round_timeout_s}) must exceed "
                f"averaging.matchmaking_time_s ({self.matchmaking_time_s})"
            )
