"""Who may join a run (a table ``[admission]`` of the run's TOML file; enforced by ``hivetrain.peers.membership``)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from hivetrain.peers.membership import peer_id_problem

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, config=_STRICT)
class AdmissionConfig:
    """Who may take part in the run (``hivetrain.peers.membership``; README "Running a public run safely").

    Args:
        mode: "open" (default): anyone who knows the address. "allowlist": only the peer IDs in ``allowlist``.
            "token": those, plus peers holding a join token for their own peer ID signed by ``issuer``
            (``hivetrain coordinator invite PEER_ID``). Every honest peer drops the DHT records of non-members, never
            groups with them, refuses their data-plane connections and neither downloads state from nor serves it to
            them. The issuer (the coordinator) is always a member.
        allowlist: base58 peer IDs (``hivetrain identity show`` prints a volunteer's), at most 4096.
        issuer: base58 peer ID whose signed join tokens count; "" = the run's coordinator (the signer of the run
            config record the joiner trusts; the coordinator itself uses its own identity).
    """

    mode: Literal["open", "allowlist", "token"] = "open"
    allowlist: tuple[str, ...] = Field(default=(), max_length=4096)
    issuer: str = ""

    def __post_init__(self) -> None:
        for i, peer_id in enumerate(self.allowlist):
            problem = peer_id_problem(peer_id)
            if problem:
                raise ValueError(f"admission.allowlist[{i}]: {problem}")
        if self.issuer and peer_id_problem(self.issuer):
            raise ValueError(f"admission.issuer: {peer_id_problem(self.issuer)}")
        if len(set(self.allowlist)) != len(self.allowlist):
            raise ValueError("admission.allowlist lists a peer ID twice")
        if self.mode == "allowlist" and not self.allowlist:
            raise ValueError(
                "admission.mode = 'allowlist' with an empty admission.allowlist would admit nobody but the "
                "coordinator: list the members' peer IDs (`hivetrain identity show` prints one) or use mode 'token'"
            )
