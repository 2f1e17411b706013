"""Lightning's spellings of the mesh, turned into the config's ``mesh``: FSDPStrategy's
``sharding_strategy`` (the FSDP1 names of ``config/fsdp1.py``) and its HSDP
``device_mesh=(replicate, shard)`` tuple, checked against ``mesh=`` and, once the node
count is known, resolved. Pure: every rank raises the same error before any collective."""

from __future__ import annotations

from typing import Any

from ..config.fsdp1 import SUPPORTED, strategy_name
from ..config.keys import suggest
from ..config.schema import MeshConfig, OverlapConfig, OverlapConfigError

__all__ = ["SHARDING_STRATEGIES", "check_mesh_arguments", "mesh_from_arguments", "resolve_mesh"]

# Lightning FSDPStrategy's ``sharding_strategy`` values the strategies accept (the table is
# ``config/fsdp1.py``, shared with Accelerate). The others are FSDP1 modes that this
# FSDP2-style layout has no switch for; each has a pointer, in the strategy's keywords.
SHARDING_STRATEGIES = SUPPORTED
_OTHER_STRATEGIES = {
    "SHARD_GRAD_OP": "reshard_after_forward=False keeps the gathered parameters from forward to backward",
    "HYBRID_SHARD_ZERO2": "sharding_strategy='HYBRID_SHARD' with reshard_after_forward=False is the same",
    "NO_SHARD": "mesh={'replicate': <world size>, 'shard': 1} replicates every parameter (DDP)",
}


def _mesh_tuple(device_mesh: Any) -> tuple[int, int] | None:
    if device_mesh is None:
        return None
    ok = (
        isinstance(device_mesh, (tuple, list))
        and len(device_mesh) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in device_mesh)
    )
    if not ok:
        raise OverlapConfigError(
            f"device_mesh: expected a tuple (replicate, shard) of two integers >= 1, got {device_mesh!r} "
            "(a DeviceMesh object is not taken: the strategy builds its own mesh from the sizes)."
        )
    return int(device_mesh[0]), int(device_mesh[1])


def _mesh_given(config: OverlapConfig) -> bool:
    return (config.mesh.replicate, config.mesh.shard) != (MeshConfig().replicate, MeshConfig().shard)


def _parallel_size(value: Any, key: str, auto: bool) -> int | str:
    if auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = " or 'auto'" if auto else ""
        raise OverlapConfigError(f"{key}: expected an integer >= 1{also}, got {value!r}.")
    return value


def check_mesh_arguments(
    config: OverlapConfig,
    sharding_strategy: Any,
    device_mesh: Any,
    tensor_parallel_size: Any = 1,
    data_parallel_size: Any = "auto",
) -> None:
    """The pure checks of the mesh spellings, at construction (no node count yet):
    ``sharding_strategy`` is a known value, ``device_mesh`` a pair of sizes,
    ``tensor_parallel_size`` / ``data_parallel_size`` (ModelParallelStrategy's names) sizes,
    and the spellings that can be compared without the node count agree (the strategies
    check once, at construction; ``resolve_mesh`` checks again for a caller that did not)."""
    tp = int(_parallel_size(tensor_parallel_size, "tensor_parallel_size", auto=False))
    _parallel_size(data_parallel_size, "data_parallel_size", auto=True)
    tensor = max(tp, config.mesh.tensor)
    if tp > 1 and config.mesh.tensor not in (1, tp):
        raise OverlapConfigError(
            f"tensor_parallel_size={tp} contradicts mesh.tensor={config.mesh.tensor}: they say the same thing, "
            "pass one of them."
        )
    hsdp = (
        config.mesh.replicate > 1
        or device_mesh is not None
        or (sharding_strategy is not None and strategy_name(sharding_strategy) == "HYBRID_SHARD")
    )
    if tensor > 1 and hsdp:
        raise OverlapConfigError(
            f"tensor_parallel_size / mesh.tensor {tensor} with HSDP (mesh.replicate, device_mesh or "
            "sharding_strategy='HYBRID_SHARD'): not available through the Lightning strategies yet (their "
            "device_mesh has Lightning's two dimensions, data_parallel x tensor_parallel); use "
            "fsdp_overlap_plugin.parallelize in your own loop for replicate x shard x tensor (docs/tensor-parallel.md)."
        )
    if sharding_strategy is not None:
        name = strategy_name(sharding_strategy)
        if name in _OTHER_STRATEGIES:
            raise OverlapConfigError(
                f"sharding_strategy={sharding_strategy!r} is not supported by the fsdp_overlap strategy; valid: "
                f"{', '.join(SHARDING_STRATEGIES)}. {_OTHER_STRATEGIES[name]}."
            )
        if name not in SHARDING_STRATEGIES:
            raise OverlapConfigError(
                f"sharding_strategy={sharding_strategy!r} is not one of {', '.join(SHARDING_STRATEGIES)}."
                f"{suggest(name, SHARDING_STRATEGIES)}"
            )
    sizes = _mesh_tuple(device_mesh)
    if sizes is not None:
        if sharding_strategy is not None and strategy_name(sharding_strategy) == "FULL_SHARD" and sizes[0] > 1:
            raise OverlapConfigError(
                f"device_mesh={sizes} replicates over {sizes[0]} groups but sharding_strategy='FULL_SHARD' shards "
                "over every rank; use sharding_strategy='HYBRID_SHARD' (or leave it out) with a device_mesh."
            )
        if _mesh_given(config) and (config.mesh.replicate, config.mesh.shard) not in (sizes, (sizes[0], -1)):
            raise OverlapConfigError(
                f"device_mesh={sizes} contradicts mesh={{'replicate': {config.mesh.replicate}, 'shard': "
                f"{config.mesh.shard}}}: they say the same thing, pass one of them."
            )
    elif sharding_strategy is not None and strategy_name(sharding_strategy) == "FULL_SHARD":
        if config.mesh.replicate > 1:
            raise OverlapConfigError(
                f"sharding_strategy='FULL_SHARD' shards over every rank but mesh.replicate is "
                f"{config.mesh.replicate}; use sharding_strategy='HYBRID_SHARD', or leave one of them out."
            )


def resolve_mesh(
    config: OverlapConfig, sharding_strategy: Any, device_mesh: Any, num_nodes: int, devices_per_node: int
) -> OverlapConfig:
    """The config with its ``mesh`` set from Lightning's spellings, once the node count is
    known (pure: every rank raises the same error before any collective).

    ``device_mesh=(R, S)`` (Lightning FSDPStrategy's HSDP tuple) -> ``mesh: {replicate: R,
    shard: S}``; ``sharding_strategy="HYBRID_SHARD"`` without it -> replicate over the
    nodes, shard within each: ``{replicate: num_nodes, shard: devices_per_node}``;
    ``"FULL_SHARD"`` -> one shard group (``replicate: 1``). ``mesh=`` given as well must
    say the same, else the error names both."""
    check_mesh_arguments(config, sharding_strategy, device_mesh)
    return mesh_from_arguments(config, sharding_strategy, device_mesh, num_nodes, devices_per_node)


def mesh_from_arguments(
    config: OverlapConfig,
    sharding_strategy: Any,
    device_mesh: Any,
    num_nodes: int,
    devices_per_node: int,
    tensor_parallel_size: int = 1,
) -> OverlapConfig:
    """``resolve_mesh`` for arguments ``check_mesh_arguments`` already passed (the strategies
    check them at construction): only the checks that need the node count run here.
    ``tensor_parallel_size`` > 1 sets ``mesh.tensor``."""
    if tensor_parallel_size > 1 and config.mesh.tensor == 1:
        ours = config.mesh
        config = config.replace(
            mesh=MeshConfig(shard=ours.shard, replicate=ours.replicate, tensor=tensor_parallel_size)
        )
    sizes = _mesh_tuple(device_mesh)
    name = strategy_name(sharding_strategy) if sharding_strategy is not None else None
    if sizes is None and name == "HYBRID_SHARD":
        sizes = (num_nodes, devices_per_node)
        ours = config.mesh
        if _mesh_given(config) and (ours.replicate, ours.shard) not in (sizes, (sizes[0], -1)):
            raise OverlapConfigError(
                f"sharding_strategy='HYBRID_SHARD' replicates over the {num_nodes} node(s) and shards over the "
                f"{devices_per_node} device(s) of each (num_nodes={num_nodes}, devices={devices_per_node}), but "
                f"mesh={{'replicate': {ours.replicate}, 'shard': {ours.shard}}}; pass one of them, or "
                f"device_mesh=(replicate, shard) for another layout."
            )
    if sizes is None:
        return config
    return config.replace(mesh=MeshConfig(replicate=sizes[0], shard=sizes[1]))
