"""What a broker replica says of itself: `GET /v1/status` (no token: probes and `gpufed status`)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Role(StrEnum):
    LEADER = "leader"
    FOLLOWER = "follower"


class ReplicaStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replica: str = Field(description="this replica's id")
    role: Role
    leader: str | None = Field(
        description="the leader's --advertise-url (this replica's own when it leads); "
        "null while no leader is known"
    )
    term: int = Field(description="the leader's term; grows with each new leader (0: none yet)")
    synced: bool = Field(description="the job cache has caught up with the store")
    active: bool = Field(
        description="the leader's work runs here (scheduling, agent sessions); false on followers"
    )
    url: str | None = Field(None, description="this replica's own --advertise-url")
