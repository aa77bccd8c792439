"""The FSDP2 device mesh of ``train.fsdp_shard``: ``world`` shards every parameter over all ranks (a flat mesh, the
default); ``node`` shards within a node and replicates across nodes (HSDP); an integer N shards over groups of N
consecutive ranks and replicates over the world / N groups. HSDP's 2-D mesh is (replicate, shard): the parameters,
gradients and optimizer state of a rank are 1/N of the model, the all-gathers stay inside a shard group (a node's
NVLink), and each micro-step all-reduces the gradient shards across the replicas."""
from __future__ import annotations


def fsdp_shard_size(spec, world: int, per_node: int | None) -> tuple[int, str | None]:
    """(ranks per shard group, None) or (world, the one-line problem). ``per_node``: ranks per node (torchrun's
    LOCAL_WORLD_SIZE, the launch plan's --gpus-per-node); None where it is not known yet."""
    if spec == "world":
        return world, None
    if spec == "node":
        if per_node is None:
            return world, None
        size, name = per_node, f"train.fsdp_shard=node ({per_node} ranks per node)"
    else:
        size, name = int(spec), f"train.fsdp_shard={spec}"
    if size > world or world % size:
        return world, (f"{name} needs a world size that is a multiple of {size}, got {world}; use a world size of "
                       f"k x {size}, or set train.fsdp_shard=world")
    return size, None


def build_mesh(spec, world: int, per_node: int | None, device_type: str):
    """None for a flat FSDP (``world``: today's ``fully_shard`` without a mesh), else the 2-D (replicate, shard)
    DeviceMesh. Raises ValueError (one line) when the world size does not divide."""
    if spec == "node" and per_node is None:
        raise ValueError("train.fsdp_shard=node needs LOCAL_WORLD_SIZE (the ranks per node, set by torchrun and grt "
                         "launch); launch with torchrun, or set train.fsdp_shard to the number of ranks per node")
    size, problem = fsdp_shard_size(spec, world, per_node)
    if problem:
        raise ValueError(problem)
    if spec == "world" or size == world:  # one shard group spanning the world: plain FSDP
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp_replicate", "dp_shard"))
