"""The mesh a plan's mesh ref names: some dims of a device mesh, or those dims flattened into one.
Pasted into printed programs (runtime.steps names which): each function imports what it needs and
calls only torch and the other pasted functions."""

from __future__ import annotations


def submesh(mesh, dims):
    """Some dims of a mesh: the mesh itself, one dim, or several (for FSDP's 2-D HSDP mesh)."""
    if tuple(dims) == tuple(mesh.mesh_dim_names):
        return mesh
    return mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]


def mesh_of(mesh, dims, flat: bool = False):
    """The mesh a plan's mesh ref names: some dims of `mesh`, or (`flat`, `world[dp*ep]`) those dims flattened
    into one, named by joining theirs with `_`."""
    return flat_mesh(mesh, dims) if flat else submesh(mesh, dims)


def flat_mesh(mesh, dims):
    """A 1-D mesh over the given dims (DDP-style replicate takes only 1-D meshes)."""
    sub = submesh(mesh, dims)
    return sub if sub.ndim == 1 else sub._flatten("_".join(dims))
