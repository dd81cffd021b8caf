"""The GPU map of one cluster (`GET /v1/clusters/{name}/gpus`): every node a row of GPU cells.

The broker never sees an agent's node list (`inventory.ClusterSummary` holds counts), but it
knows every pod it placed: the node and the GPU indices the agent reported. So the map has two
parts, and says which is which:

- `nodes`: the nodes holding pods of gpufed jobs, by name, each GPU cell exact;
- `others`: the rest of each GPU model's nodes, from the summary's histogram of free GPUs
  (`nodes_by_free`), in groups of alike rows (`count` nodes whose cells read `cells`): names
  unknown, the number of free GPUs per node known.

A cell is one character: `W` a gpufed pod holds the whole GPU, `S` gpufed pods share it
(milli-GPU), `F` free, `O` held by something else or not schedulable (a node not ready,
cordoned, a GPU the agent counts unavailable or used outside gpufed).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Cell(StrEnum):
    WHOLE = "W"
    SHARED = "S"
    FREE = "F"
    OTHER = "O"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class MapModel(_Model):
    model: str
    gpus_per_node: int = Field(alias="gpusPerNode")
    nodes: int
    total: int
    free: int


class MapNode(_Model):
    """A node holding pods of gpufed jobs: its cells, exact."""

    name: str
    model: str
    cells: str = Field(description="one character per GPU index: W, S, F or O")
    jobs: list[str] = Field(
        default_factory=list, description="the jobs with pods here that the caller may see"
    )


class MapGroup(_Model):
    """`count` nodes of `model` without gpufed pods whose cells read `cells`."""

    model: str
    cells: str
    count: int


class GpuMap(_Model):
    cluster: str
    health: str
    models: list[MapModel] = Field(default_factory=list)
    nodes: list[MapNode] = Field(default_factory=list)
    others: list[MapGroup] = Field(default_factory=list)
    message: str = ""

    @property
    def rows(self) -> int:
        return len(self.nodes) + sum(g.count for g in self.others)
