"""The ``mesh`` key: the sizes of the device mesh's dimensions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..contract import OverlapConfigError
from .keys import check_keys

__all__ = ["MeshConfig", "mesh_from_value"]


@dataclass
class MeshConfig:
    """The device mesh: ``replicate`` x ``shard`` data-parallel ranks, times ``tensor``
    tensor-parallel ranks (the innermost dimension: the ranks of one tensor-parallel group
    are consecutive, so on one node)."""

    shard: int = -1
    """Ranks a parameter is sharded over (FSDP group size); -1 means the rest: world_size //
    (tensor * replicate)."""

    replicate: int = 1
    """Replica groups; > 1 turns on HSDP (shard inside a group, all-reduce across groups)."""

    tensor: int = 1
    """Tensor-parallel ranks (the innermost dimension); > 1 needs a tensor-parallel plan
    (tp_plan, or the model's own parallelize_module) and divides the world size first."""

    def sizes(self, world_size: int) -> tuple[int, int]:
        """``(replicate, shard)`` for this world size (the data-parallel ranks: the world
        size over ``tensor``); raises if they do not multiply to it."""
        if world_size % self.tensor:
            raise OverlapConfigError(
                f"mesh.tensor={self.tensor} does not divide the world size {world_size}; "
                f"valid values: {_divisors(world_size)}."
            )
        world_size //= self.tensor
        replicate, shard = self.replicate, self.shard
        if shard == -1:
            if world_size % replicate:
                raise OverlapConfigError(
                    f"mesh.replicate={replicate} does not divide the "
                    + (
                        f"{world_size} data-parallel ranks (world size {world_size * self.tensor} / tensor={self.tensor})"
                        if self.tensor > 1
                        else f"world size {world_size}"
                    )
                    + "; "
                    f"valid values: {_divisors(world_size)}."
                )
            shard = world_size // replicate
        if replicate * shard != world_size:
            raise OverlapConfigError(
                f"mesh: replicate={replicate} x shard={shard} = {replicate * shard} ranks, "
                f"but the world size is {world_size}"
                + (
                    f" data-parallel ranks ({world_size * self.tensor} / tensor={self.tensor})"
                    if self.tensor > 1
                    else ""
                )
                + f". Set shard: -1 to derive it, or pick sizes whose product is {world_size}."
            )
        return replicate, shard


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_from_value(value: Any, source: str) -> MeshConfig:
    if isinstance(value, MeshConfig):
        return value
    if value is None:
        return MeshConfig()
    if not isinstance(value, dict):
        raise OverlapConfigError(f"{source}: mesh: expected a mapping like {{shard: -1, replicate: 1}}, got {value!r}.")
    check_keys(
        value,
        [f.name for f in dataclasses.fields(MeshConfig)],
        source=source,
        shown=lambda key: f"'mesh.{key}'",
        tail="Valid keys: mesh.shard, mesh.replicate, mesh.tensor.",
    )
    return MeshConfig(**value)
