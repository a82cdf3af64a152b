"""The layout of ranks made live: the DeviceMesh built from a validated layout.

A :class:`~disttrain.config.layout.Layout` is pure data, checked against a world size
before any process group exists. :class:`Topology` pairs it with the live ``DeviceMesh``
(one named axis per declared dimension, :data:`MESH_AXES`, outermost first) and this
rank's coordinates; it is passed explicitly to every strategy that needs a group. The
groups of a role (the replica group a data-parallel strategy reduces over, the ranks a
batch is split over) are the flattened axes of the dimensions that take it. Nothing here
is module-level state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config.layout import Layout
from ..dimensions import Role, mesh_order, with_role
from ..errors import ConfigError

MESH_AXES = tuple(d.axis for d in mesh_order())


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

    def role_axes(self, role: Role) -> tuple[str, ...]:
        """The mesh axes of the dimensions that take ``role``, outermost first."""
        return tuple(d.axis for d in with_role(role))

    def role_group(self, role: Role) -> dist.ProcessGroup:
        """The group of the ranks that differ from this one only on ``role``'s axes (one
        axis: that axis's group; several: their flattened group)."""
        axes = self.role_axes(role)
        return self.mesh[axes]._flatten().get_group()

    def role_index(self, role: Role) -> int:
        """This rank's index among the ranks of :meth:`role_group` (row-major over the
        role's axes, outermost first)."""
        index = 0
        for axis in self.role_axes(role):
            index = index * self._size(axis) + self.coordinate(axis)
        return index

    def _size(self, axis: str) -> int:
        return self.mesh.size(MESH_AXES.index(axis))


def build_topology(layout: Layout, device_type: str) -> Topology:
    """Create the DeviceMesh (process group must already be initialised)."""
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ConfigError("parallel", layout, f"layout needs {layout.world_size} ranks, "
                          f"the job has {world}", "match --nproc to the layout")
    mesh = init_device_mesh(device_type, layout.shape(), mesh_dim_names=MESH_AXES)
    return Topology(layout=layout, mesh=mesh)
