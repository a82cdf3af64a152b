"""The layout of ranks made live: the DeviceMesh built from a validated (dp, pp, tp, zero).

A :class:`~disttrain.config.layout.Layout` is pure data, checked against a world size
before any process group exists. :class:`Topology` pairs it with the live ``DeviceMesh``
(named axes ``pp``, ``dp``, ``tp``, outermost first) and this rank's coordinates; it is
passed explicitly to every strategy that needs a group. Nothing here is module-level
state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config.layout import Layout
from ..errors import ConfigError

MESH_AXES = ("pp", "dp", "tp")

@dataclass(frozen=True)
class Topology:
    """A layout made live: the mesh and this rank's place in it."""

    layout: Layout
    mesh: DeviceMesh

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)

    def coordinate(self, axis: str) -> int:
        return self.mesh.get_local_rank(axis)

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp")

    @property
    def dp_size(self) -> int:
        return self.layout.dp


def build_topology(layout: Layout, device_type: str) -> Topology:
    """Create the DeviceMesh (process group must already be initialised)."""
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ConfigError("parallel", layout, f"layout needs {layout.world_size} ranks, "
                          f"the job has {world}", "match --nproc to the layout")
    mesh = init_device_mesh(device_type, layout.shape(), mesh_dim_names=MESH_AXES)
    return Topology(layout=layout, mesh=mesh)
