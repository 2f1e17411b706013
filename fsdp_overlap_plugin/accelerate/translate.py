"""Accelerate's settings turned into ``OverlapConfig`` fields: ``build_config``, one named
step per Accelerate key the plugin shares (``mixed_precision``, ``fsdp_reshard_after_forward``,
the mesh from ``parallelism_config`` / ``fsdp_sharding_strategy``,
``fsdp_activation_checkpointing``), after the settings the plugin replaces are refused.

Accelerate's key decides; an ``fsdp_overlap_*`` key the user set that contradicts it is
an error naming both. Every message spells a key as the user's file spells it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config.keys import suggest
from ..config.parse import dtype_name, parse_dtype
from ..config.schema import OverlapConfig, OverlapConfigError, respell
from .keys import key_for
from .settings import AccelerateSettings

__all__ = ["build_config", "rename_error"]

_MIXED_PRECISION = {"no": None, "bf16": "bf16", "fp16": "fp16"}


def _key(name: str, prefixed: bool) -> str:
    return f"fsdp_config.{key_for(name)}" if prefixed else name


def rename_error(exc: OverlapConfigError, source: str, prefixed: bool) -> OverlapConfigError:
    """The same error, with the key spelled as the user wrote it (core messages start with
    the field name, ``bucket_plans[2]: ...``; the YAML says ``fsdp_overlap_bucket_plans``)
    and the file named."""
    message = respell(str(exc), lambda name: _key(name, prefixed))
    if source and not message.startswith(source):
        message = f"{source}: {message}"
    return OverlapConfigError(message)


@dataclass
class _Job:
    """What every step reads: the keys the user set, Accelerate's settings, and how the
    messages name the file and spell the keys."""

    given: set[str]
    settings: AccelerateSettings
    source: str
    prefixed: bool

    @property
    def at(self) -> str:
        return f"{self.source}: " if self.source else ""

    def key(self, name: str) -> str:
        return _key(name, self.prefixed)

    def where(self, attr: str) -> str | None:
        return self.settings.where.get(attr)

    def conflict(self, name: str, ours: Any, theirs: str, fix: str) -> OverlapConfigError:
        return OverlapConfigError(
            f"{self.at}{self.key(name)} is {ours!r} but Accelerate's {theirs}; the two must agree. {fix}"
        )


def build_config(
    values: dict[str, Any],
    given: set[str],
    settings: AccelerateSettings,
    *,
    model: Any = None,
    source: str = "",
    prefixed: bool = True,
    model_later: bool = False,
) -> OverlapConfig:
    """The ``OverlapConfig`` for this job: ``values`` (plugin keys, unprefixed), with
    Accelerate's shared keys applied. ``given`` are the keys the user actually set (only
    those can contradict Accelerate). ``model`` is needed only to turn
    ``fsdp_activation_checkpointing: true`` into the model's repeated blocks;
    ``model_later`` (``fsdp-overlap check`` without a model) leaves that step out."""
    values = dict(values)
    job = _Job(given, settings, source, prefixed)
    _refuse_what_the_plugin_replaces(job)
    _apply_mixed_precision(job, values)
    _apply_reshard_after_forward(job, values)
    _apply_mesh(job, values)
    _apply_tensor_parallel(job, values)
    _apply_activation_checkpointing(job, values, model, model_later)
    try:
        where = (f"{source}: fsdp_config" if source else "fsdp_config") if prefixed else (source or "config")
        config = OverlapConfig.from_dict(values, source=where)
    except OverlapConfigError as exc:
        raise rename_error(exc, source, prefixed) from None
    return config


def _apply_tensor_parallel(job: _Job, values: dict[str, Any]) -> None:
    """``parallelism_config_tp_size`` -> ``mesh.tensor``. Under Accelerate the tensor
    dimension is Accelerate's to say: its data loader gives the ranks of one
    tensor-parallel group the same batches only where its ``ParallelismConfig`` has the
    ``tp`` dimension, so ``mesh.tensor`` alone (or a ``tp_plan`` without either) is an
    error that names the key to set, and the two spellings must agree."""
    theirs = job.settings.tensor
    try:
        ours = OverlapConfig.from_dict({"mesh": values.get("mesh")}).mesh.tensor
    except OverlapConfigError as exc:
        raise rename_error(exc, job.source, job.prefixed) from None
    if theirs is None:
        if ours > 1:
            raise OverlapConfigError(
                f"{job.at}{job.key('mesh')}: tensor is {ours}, but Accelerate's parallelism_config has no tp_size; "
                f"set parallelism_config_tp_size: {ours} (or ParallelismConfig(tp_size={ours}, ...)): Accelerate's "
                "data loader gives the ranks of one tensor-parallel group the same batches only when it knows the "
                f"tensor dimension. {job.key('mesh')}.tensor may then be left out."
            )
        if values.get("tp_plan"):
            raise OverlapConfigError(
                f"{job.at}{job.key('tp_plan')} splits modules over tensor-parallel ranks, but Accelerate's "
                "parallelism_config has no tp_size: set parallelism_config_tp_size (the tensor-parallel group size, "
                "e.g. 2) or remove the tp_plan."
            )
        return
    if ours not in (1, theirs):
        raise job.conflict(
            "mesh",
            {"tensor": ours},
            job.where("tensor"),
            f"Remove {job.key('mesh')}.tensor (parallelism_config_tp_size decides) or make it say the same.",
        )
    mesh = values.get("mesh")
    values["mesh"] = {**(mesh if isinstance(mesh, dict) else {}), "tensor": theirs}


def _refuse_what_the_plugin_replaces(job: _Job) -> None:
    """FSDP1, CPU offload and Accelerate's own ``torch.compile``: the plugin does each its way."""
    settings = job.settings
    if settings.fsdp_version is not None and settings.fsdp_version != 2:
        raise OverlapConfigError(
            f"{job.at}fsdp_config.fsdp_version is {settings.fsdp_version} "
            f"({job.where('fsdp_version')}); fsdp-overlap keeps FSDP2's parameter layout: set fsdp_version: 2."
        )
    if settings.offload_params:
        raise OverlapConfigError(
            f"{job.at}fsdp_config.fsdp_offload_params is true "
            f"({job.where('offload_params')}); fsdp-overlap does not offload parameters to the CPU: "
            "set fsdp_offload_params: false."
        )
    if settings.dynamo_backend is not None and settings.dynamo_backend.upper() != "NO":
        raise OverlapConfigError(
            f"{job.at}dynamo_config.dynamo_backend is {settings.dynamo_backend!r} "
            f"({job.where('dynamo_backend')}); fsdp-overlap compiles the model itself "
            f"({job.key('compile')}, {job.key('backend')}): remove dynamo_config or set "
            "dynamo_backend: 'NO' (with transformers' Trainer: leave TrainingArguments' torch_compile off)."
        )


def _apply_mixed_precision(job: _Job, values: dict[str, Any]) -> None:
    """``mixed_precision`` -> ``param_dtype`` (``"no"`` leaves the dtypes alone)."""
    mp = job.settings.mixed_precision
    if mp is None:
        return
    if mp not in _MIXED_PRECISION:
        raise OverlapConfigError(
            f"{job.at}mixed_precision {mp!r} ({job.where('mixed_precision')}) "
            f"is not supported by fsdp-overlap; valid: {', '.join(_MIXED_PRECISION)}."
            f"{suggest(mp, list(_MIXED_PRECISION))}"
        )
    wanted = _MIXED_PRECISION[mp]
    ours = values.get("param_dtype")
    if "param_dtype" in job.given and ours is not None:
        try:
            ours_name = dtype_name(parse_dtype(ours, job.key("param_dtype")))
        except OverlapConfigError as exc:
            raise rename_error(exc, job.source, False) from None
        agrees = ours_name == wanted if wanted is not None else ours_name == "fp32"
        if not agrees:
            raise job.conflict(
                "param_dtype",
                ours,
                f"mixed_precision is {mp!r} ({job.where('mixed_precision')})",
                f"Set mixed_precision to {ours_name!r}, or remove {job.key('param_dtype')} "
                "(it follows mixed_precision).",
            )
    if wanted is not None:
        values["param_dtype"] = wanted


def _apply_reshard_after_forward(job: _Job, values: dict[str, Any]) -> None:
    """``fsdp_reshard_after_forward`` -> ``reshard_after_forward``."""
    theirs = job.settings.reshard_after_forward
    if theirs is None:
        return
    if "reshard_after_forward" in job.given and values.get("reshard_after_forward") != theirs:
        raise job.conflict(
            "reshard_after_forward",
            values.get("reshard_after_forward"),
            f"fsdp_reshard_after_forward is {str(theirs).lower()} ({job.where('reshard_after_forward')})",
            f"Set both to the same value (fsdp_reshard_after_forward decides; {job.key('reshard_after_forward')} "
            "may be left out).",
        )
    values["reshard_after_forward"] = theirs


def _accelerate_mesh(job: _Job) -> tuple[tuple[int, int] | None, str]:
    """``(replicate, shard)`` as Accelerate asks for it, and where that was said:
    ``parallelism_config``'s dp sizes, or ``fsdp_sharding_strategy: HYBRID_SHARD``
    (replicate over the machines); the two must agree. ``(None, "")`` when neither is set."""
    settings = job.settings
    theirs_mesh, theirs_where = None, ""
    if settings.dp_replicate is not None:
        theirs_mesh, theirs_where = (settings.dp_replicate, settings.dp_shard), settings.where["parallelism"]
    if settings.sharding_strategy == "HYBRID_SHARD":
        hybrid_where = (
            f"fsdp_sharding_strategy is HYBRID_SHARD ({job.where('sharding_strategy')}): replicate over "
            f"{settings.machines} machine(s) ({job.where('machines')})"
        )
        if theirs_mesh is not None and theirs_mesh[0] != settings.machines:
            raise OverlapConfigError(
                f"{job.at}{hybrid_where}, but {theirs_where}; the two must agree. Remove "
                "fsdp_sharding_strategy (parallelism_config decides) or make the replicate size the machine count."
            )
        if theirs_mesh is None:
            theirs_mesh, theirs_where = (settings.machines, -1), hybrid_where
    return theirs_mesh, theirs_where


def _apply_mesh(job: _Job, values: dict[str, Any]) -> None:
    """``parallelism_config`` dp sizes / ``fsdp_sharding_strategy: HYBRID_SHARD`` -> ``mesh``."""
    theirs_mesh, theirs_where = _accelerate_mesh(job)
    if theirs_mesh is None:
        return
    try:
        ours = OverlapConfig.from_dict({"mesh": values.get("mesh")}).mesh
    except OverlapConfigError as exc:
        raise rename_error(exc, job.source, job.prefixed) from None
    # the default ({replicate: 1, shard: -1}, written out in configs/overlap.yaml) asks nothing
    if "mesh" in job.given and ours != OverlapConfig().mesh:
        shards_agree = ours.shard == theirs_mesh[1] or -1 in (ours.shard, theirs_mesh[1])
        if ours.replicate != theirs_mesh[0] or not shards_agree:
            raise job.conflict(
                "mesh",
                {"replicate": ours.replicate, "shard": ours.shard},
                theirs_where,
                f"Remove {job.key('mesh')} (Accelerate's key decides) or make it say the same.",
            )
    tensor = (values.get("mesh") or {}).get("tensor") if isinstance(values.get("mesh"), dict) else None
    values["mesh"] = {"replicate": theirs_mesh[0], "shard": theirs_mesh[1]}
    if tensor is not None:
        values["mesh"]["tensor"] = tensor  # _apply_tensor_parallel compares it with Accelerate's tp_size


def _apply_activation_checkpointing(job: _Job, values: dict[str, Any], model: Any, model_later: bool) -> None:
    """``fsdp_activation_checkpointing`` -> ``activation_checkpointing`` (true: the model's
    repeated blocks, unless the user listed modules)."""
    wanted = job.settings.activation_checkpointing
    if wanted is None:
        return
    ours_ac = values.get("activation_checkpointing") or []
    if isinstance(ours_ac, str):
        ours_ac = [ours_ac]
    where = job.where("activation_checkpointing")
    if not wanted and ours_ac:
        raise job.conflict(
            "activation_checkpointing",
            ours_ac,
            f"fsdp_activation_checkpointing is false ({where})",
            "Set fsdp_activation_checkpointing: true to checkpoint these modules.",
        )
    if wanted and not ours_ac and not (model is None and model_later):
        if model is None:
            raise OverlapConfigError("fsdp_activation_checkpointing: true needs the model to find its repeated blocks.")
        from ..config.plan import find_repeated_blocks

        blocks = find_repeated_blocks(model)
        if blocks is None:
            raise OverlapConfigError(
                f"{job.at}fsdp_activation_checkpointing is true ({where}) but the model "
                f"has no repeated blocks to checkpoint; list the modules in {job.key('activation_checkpointing')}."
            )
        values["activation_checkpointing"] = blocks[1]
