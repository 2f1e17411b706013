"""``Trainer(strategy="fsdp_overlap")``: the Lightning Trainer strategy.

Lifecycle (each hook does one thing and calls the core):

    setup_environment   precision -> param/reduce dtypes (checked), process group
                        (cuda -> nccl, npu -> hccl, cpu -> gloo), the data-parallel mesh
                        of the core (``(shard,)`` or ``(replicate, shard)``: every rank is
                        a data-parallel rank, no tensor-parallel axis)
    configure_model     (the user's hook, run by the Trainer; may build on the meta device)
    setup               cast for "-true" precisions -> ``parallelize`` (plan, shard, compile
                        in place) -> ``materialize`` if on meta -> optimizers; checkpoint
                        loading comes after this, onto the shards
    optimizer_step      after the first one: the schedule report, to the console and as
                        ``self.log`` metrics (``fsdp_overlap/...``)
    checkpoints         sharded (DCP directory) by default, one full file with
                        ``state_dict_type="full"`` (``save_distributed_checkpoint=False``);
                        parameters are read as shards, never gathered one by one; written
                        beside the name and renamed into place when every rank has written
                        (an old ``last.ckpt`` is replaced only by a complete one); an
                        incomplete folder is refused by name before loading

The class is written as a mixin so that the same code serves ``lightning.pytorch`` and
the standalone ``pytorch_lightning`` package (``standalone.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.nn as nn
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from .._lightning_compat import current_hook_name, set_module_device_mesh, set_strategy_device_mesh
from ..config.schema import OverlapConfig
from ..core import (
    build_mesh,
    format_report,
    get_state,
    install_excepthook,
    refuse_tensor_parallel_checkpoint,
    replica_all_reduce_skipped,
    schedule_report,
)
from ._common import (
    CONFIG_FIELDS,
    LIGHTNING_MESH_NAMES,
    StrategyBase,
    align_autocast_device,
    build_config,
    check_loadable,
    checked_arguments,
    distributed_checkpoint,
    log_once,
    no_gathers,
    parallelize_once,
    precision_of,
    remove_local_checkpoint,
    report_metrics,
    saved_atomically,
    select_target,
    warn_if_npu_unused,
)

__all__ = ["FSDPOverlapStrategy", "TrainerStrategyMixin"]


class TrainerStrategyMixin(StrategyBase):
    """The Trainer strategy's behaviour, on top of Lightning's ``ModelParallelStrategy``.

    Args:
        config: an ``OverlapConfig``, a dict of its keys, or a YAML path. The plain
            string ``"fsdp_overlap"`` means the defaults: ``bucket_plans: auto``, all
            passes on.
        module: which module of the LightningModule to parallelize and compile:
            ``"auto"`` (the single child holding all parameters, else the
            LightningModule), ``""`` (the LightningModule: call ``self(x)``), or an FQN.
            Bucket plans are written relative to it.
        save_distributed_checkpoint: True (default) writes a sharded distributed
            checkpoint (a directory, one file per rank); False gathers one full file on
            rank 0.
        state_dict_type: the same choice in the words of Lightning's FSDP strategies:
            ``"sharded"`` (default) or ``"full"``. The model's weights as a
            ``save_pretrained`` folder: ``fsdp_overlap_plugin.save_pretrained(self.model,
            out)`` on every rank, or ``fsdp-overlap export CHECKPOINT OUT`` afterwards.
        process_group_backend: overrides the backend (default: nccl / hccl / gloo for
            cuda / npu / cpu).
        timeout: process-group timeout.
        sharding_strategy: Lightning ``FSDPStrategy``'s spelling of the mesh:
            ``"HYBRID_SHARD"`` replicates over the nodes and shards within each
            (``mesh: {replicate: num_nodes, shard: devices}``); ``"FULL_SHARD"`` shards
            over every rank (``replicate: 1``, the default). Others are an error.
        device_mesh: ``(replicate, shard)``, as Lightning ``FSDPStrategy`` takes it for
            HSDP: ``mesh: {replicate: R, shard: S}``. ``mesh=`` given too must say the
            same (an error names both).
        bucket_plans ... separate_gather_group: any ``OverlapConfig`` key; a value left
            at None keeps the one from ``config`` (or the default).

    Precision: ``Trainer(precision=...)`` sets ``param_dtype`` / ``reduce_dtype``
    (``"bf16-mixed"``: gather in bf16, reduce in fp32, autocast kept; ``"bf16-true"``:
    bf16 shards, bf16 reduce; ``"32-true"``: fp32). A dtype set in the config wins if
    it is compatible with the precision and is an error if it contradicts it.

    Gradient accumulation (``accumulate_grad_batches``): the reduce-scatter of each
    gradient is part of the compiled backward graph, so every micro-batch reduces its
    gradients over the shard group; the sharded gradients accumulate in ``param.grad``.
    On HSDP (``mesh.replicate > 1``) the micro-batches that accumulate skip the
    all-reduce across replicas, and the last one all-reduces the accumulated sum
    (``block_backward_sync``, ``runtime/accumulation.py``). The result equals one large batch.
    """

    _lightning_package = "lightning.pytorch"

    @checked_arguments
    def __init__(
        self,
        config: OverlapConfig | dict | str | None = None,
        *,
        module: str = "auto",
        save_distributed_checkpoint: bool | None = None,
        state_dict_type: str | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        sharding_strategy: str | None = None,
        device_mesh: tuple[int, int] | None = None,
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int = 1,
        bucket_plans: str | list | None = None,
        bucket_bytes: int | str | None = None,
        manual_bucketing: bool | None = None,
        overlap_grad_reduce: bool | None = None,
        reshard_after_forward: bool | None = None,
        reshard_last_bucket: bool | None = None,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        compile: bool | None = None,
        backend: str | None = None,
        fullgraph: bool | None = None,
        dynamic: bool | str | None = None,
        mesh: dict | None = None,
        tp_plan: dict | None = None,
        async_tp: bool | None = None,
        activation_checkpointing: list | None = None,
        activation_checkpointing_policy: str | None = None,
        separate_gather_group: bool | None = None,
        reduce_scatter_impl: str | None = None,
        prefetch_depth: int | None = None,
        max_prefetch_bytes: int | str | None = None,
        inductor_overlap: str | None = None,
        hardware: str | dict | None = None,
        compute_profile: str | None = None,
        rank_check: str | None = None,
        rank_check_timeout: float | None = None,
        on_compile_error: str | None = None,
        on_unbucketed: str | None = None,
        on_uninitialized: str | None = None,
    ) -> None:
        overrides = {k: v for k, v in locals().items() if k in CONFIG_FIELDS}
        self._user_config = build_config(config, overrides)  # a wrong key fails here, at Trainer(...)
        self._config: OverlapConfig | None = None
        self._module_spec = module
        self._init_mesh_arguments(sharding_strategy, device_mesh, tensor_parallel_size, data_parallel_size)
        self._parallelized: nn.Module | None = None
        # a tensor-parallel model's sharded checkpoints are tested; its full ones not yet
        self._sharded_checkpoints = distributed_checkpoint(save_distributed_checkpoint, state_dict_type)
        self.schedule_report: dict | None = None
        super().__init__(  # type: ignore[call-arg]
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=self._sharded_checkpoints,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    # ------------------------------------------------------------- environment
    def _precision_flag(self) -> str:
        return precision_of(self.precision_plugin)

    @override
    def setup_environment(self) -> None:
        # The config completed (and checked) when the Trainer was built: every rank has it
        # before any collective.
        config = self._config_for_setup()
        self._align_precision_device()
        self._setup_distributed()  # device, seed, ranks, process group
        install_excepthook()  # outermost again, over init_process_group's (report/messages.py)
        # with tensor parallelism, Lightning's names: configure_model reads
        # self.device_mesh["tensor_parallel"], as under ModelParallelStrategy
        names = LIGHTNING_MESH_NAMES if config.mesh.tensor > 1 else None
        set_strategy_device_mesh(self, build_mesh(config, self.root_device.type, names=names))
        # configure_model() may read it, as with ModelParallelStrategy.
        set_module_device_mesh(self.lightning_module, self.device_mesh)
        warn_if_npu_unused(self.root_device)

    def _align_precision_device(self) -> None:
        """Lightning builds its autocast plugin for "cuda" unless the accelerator is cpu
        or mps; on an NPU, autocast must target "npu"."""
        align_autocast_device(self.precision_plugin, self.root_device)

    # -------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        root = self.lightning_module

        def choose_target() -> nn.Module:
            # "-true" precisions: cast before sharding, so the shards are in that dtype.
            self.model = self.precision_plugin.convert_module(self.model)
            return select_target(root, self._module_spec)[1]

        self._parallelized = parallelize_once(
            root,
            choose_target,
            self.overlap_config,
            self.device_mesh,
            self.root_device,
        )
        self.barrier()
        if _fn(trainer) == "fit":
            self.setup_optimizers(trainer)
            if trainer.accumulate_grad_batches > 1:
                hsdp = len(self.device_mesh.shape) == 2 and self.device_mesh.shape[0] > 1
                log_once(
                    self._log,
                    "accumulate",
                    f"fsdp_overlap: accumulate_grad_batches={trainer.accumulate_grad_batches}: every micro-batch "
                    "reduce-scatters its gradients over the shard group inside the compiled backward; the "
                    "sharded gradients accumulate locally"
                    + (
                        ", and the all-reduce across replicas runs on the last micro-batch only."
                        if hsdp
                        else ", so results equal one reduction per optimizer step."
                    ),
                )
        self.setup_precision_plugin()

    # ---------------------------------------------------------------- training
    @override
    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's loop runs the micro-batches that accumulate inside this: on HSDP
        they skip the replica all-reduce, and the last micro-batch reduces the sum
        (``runtime/accumulation.py``). The reduce-scatter runs on every micro-batch."""
        with replica_all_reduce_skipped(self._parallelized):
            yield None

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if self.schedule_report is None and self._parallelized is not None:
            self._report_first_step()
        return output

    def _report_first_step(self) -> None:
        report = schedule_report(self._parallelized)
        self.schedule_report = report
        state = get_state(self._parallelized)
        if report["mode"] == "compiled" and state is not None and not state.called:
            rank_zero_warn(
                "fsdp_overlap: the first training step did not run the compiled forward of the parallelized "
                f"module ({type(self._parallelized).__name__}); its parameters were gathered eagerly, one by one. "
                "Call it (self(x) or self.<module>(x)) in training_step, or choose it with "
                "FSDPOverlapStrategy(module=...)."
            )
        if self.global_rank == 0:
            self._log.info(format_report(report))
        module = self.lightning_module
        if module is not None and current_hook_name(module) is not None:  # self.log works only in a hook
            module.log_dict(report_metrics(report), on_step=True, on_epoch=False)

    # ------------------------------------------------------------- checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        with no_gathers():
            return super().lightning_module_state_dict()  # type: ignore[misc]

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        with no_gathers():
            return super().optimizer_state(optimizer)  # type: ignore[misc]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Lightning's save (a DCP folder and ``meta.pt``, or one full file), written beside
        ``filepath`` and renamed into place once every rank has written: a kill mid-save
        leaves the previous checkpoint of that name, complete."""
        if self._parallelized is not None and not self._sharded_checkpoints:
            refuse_tensor_parallel_checkpoint(self._parallelized, "Trainer checkpoint save (state_dict_type='full')")
        path = Path(self.broadcast(filepath))
        with saved_atomically(path, checkpoint.get("global_step")) as partial:
            super().save_checkpoint(checkpoint, partial, storage_options=storage_options)  # type: ignore[misc]

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """``ModelCheckpoint`` dropping an old top-k checkpoint: renamed out of sight, then
        deleted, so a kill never leaves half of it under its name."""
        if not self.is_global_zero:  # type: ignore[attr-defined]
            return
        if not remove_local_checkpoint(filepath):
            super().remove_checkpoint(filepath)  # type: ignore[misc]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if self._parallelized is not None and not path.is_dir():  # a full checkpoint file: not tested yet
            refuse_tensor_parallel_checkpoint(self._parallelized, f"Trainer checkpoint load of the full file {path}")
        check_loadable(path)  # an incomplete folder is named, with the newest complete one beside it
        with no_gathers():
            return super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]


def _fn(trainer: Any) -> str | None:
    fn = trainer.state.fn
    return None if fn is None else str(getattr(fn, "value", fn))


class FSDPOverlapStrategy(TrainerStrategyMixin, ModelParallelStrategy):
    __doc__ = TrainerStrategyMixin.__doc__
    _lightning_package = "lightning.pytorch"
