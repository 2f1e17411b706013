"""``Fabric(strategy="fsdp_overlap")``: the Fabric strategy.

setup_environment   precision -> dtypes (checked), process group, data-parallel mesh
                    (``mesh=``, or Lightning's ``sharding_strategy="HYBRID_SHARD"``:
                    replicate over ``num_nodes``, shard over ``devices``, or
                    ``device_mesh=(replicate, shard)``)
setup_module        ``parallelize`` (plan, shard, compile in place), ``materialize``
                    on meta; ``fabric.setup(model, optimizer)`` re-points the
                    optimizer at the sharded parameters (an optimizer must not keep
                    references to the replaced full-size ones)
backward            after the first one: the schedule report to the console and in
                    ``strategy.schedule_report`` / ``strategy.schedule_metrics``
no_backward_sync    on HSDP, the micro-batches inside skip the replica all-reduce
                    and the next backward reduces the sum; the reduce-scatter is in
                    the compiled backward graph and runs on every micro-batch
checkpoints         sharded by default, full with ``state_dict_type="full"``
                    (``save_distributed_checkpoint=False``); written beside the name and
                    renamed into place when every rank has written; an incomplete
                    folder is refused by name before loading
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.nn as nn
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from .._lightning_compat import set_backward_sync_control, set_strategy_device_mesh
from ..config.schema import OverlapConfig, OverlapConfigError
from ..core import (
    build_mesh,
    format_report,
    install_excepthook,
    refuse_tensor_parallel_checkpoint,
    replica_all_reduce_skipped,
    replica_sync_of,
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
    report_metrics,
    saved_atomically,
    warn_if_npu_unused,
)

__all__ = ["FSDPOverlapFabricStrategy", "FabricStrategyMixin"]


class _ReplicaSyncControl:
    """Fabric's ``no_backward_sync``: on HSDP the replica all-reduce is skipped inside
    (``runtime/accumulation.py``); the reduce-scatter is compiled into the backward and runs on
    every micro-batch."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if enabled and replica_sync_of(module) is not None:
            return replica_all_reduce_skipped(module)
        if enabled:
            log_once(
                self._logger,
                "no_backward_sync",
                "fsdp_overlap: no_backward_sync() does not skip the reduce-scatter (it is part of the compiled "
                "backward graph); the reduced, sharded gradients accumulate, so results are unchanged.",
            )
        return nullcontext()


class FabricStrategyMixin(StrategyBase):
    """The Fabric strategy's behaviour, on top of Fabric's ``ModelParallelStrategy``.

    Takes the same arguments as the Trainer strategy (``FSDPOverlapStrategy``) except
    ``module``: Fabric parallelizes the module given to ``fabric.setup``/``setup_module``.
    """

    _lightning_package = "lightning.fabric"

    @checked_arguments
    def __init__(
        self,
        config: OverlapConfig | dict | str | None = None,
        *,
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
        self._user_config = build_config(config, overrides)
        self._config: OverlapConfig | None = None
        self.schedule_report: dict | None = None
        self._init_mesh_arguments(sharding_strategy, device_mesh, tensor_parallel_size, data_parallel_size)
        self.schedule_metrics: dict[str, float] = {}
        self._parallelized: nn.Module | None = None
        # a tensor-parallel model's sharded checkpoints are tested; its full ones not yet
        self._sharded_checkpoints = distributed_checkpoint(save_distributed_checkpoint, state_dict_type)
        super().__init__(  # type: ignore[call-arg]
            parallelize_fn=self._parallelize,
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=self._sharded_checkpoints,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        set_backward_sync_control(self, _ReplicaSyncControl(self._log))

    def _precision_flag(self) -> str:
        return precision_of(self.precision)

    @override
    def setup_environment(self) -> None:
        config = self._config_for_setup()  # completed (and checked) when Fabric(...) was built
        align_autocast_device(self.precision, self.root_device)
        # Not ModelParallelStrategy.setup_environment: its (data, tensor) mesh is not ours.
        self.accelerator.setup_device(self.root_device)
        self._setup_distributed()  # seed, ranks, process group
        install_excepthook()  # outermost again, over init_process_group's (report/messages.py)
        # with tensor parallelism, Lightning's names: configure_model reads
        # self.device_mesh["tensor_parallel"], as under ModelParallelStrategy
        names = LIGHTNING_MESH_NAMES if config.mesh.tensor > 1 else None
        set_strategy_device_mesh(self, build_mesh(config, self.root_device.type, names=names))
        warn_if_npu_unused(self.root_device)

    # ------------------------------------------------------------------ module
    def _parallelize(self, module: nn.Module, mesh: Any) -> nn.Module:
        """Fabric's ``parallelize_fn``: called by ``setup_module`` with our mesh."""
        self._parallelized = parallelize_once(module, lambda: module, self.overlap_config, mesh, self.root_device)
        return module

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        # Sharding replaces every parameter by a new one; an optimizer built before that
        # would step the old, full-size tensors. Re-point it, by parameter name.
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        for optimizer in optimizers:
            if optimizer.state:
                raise OverlapConfigError(
                    "fsdp_overlap: the optimizer already has state; set up the model first "
                    "(fabric.setup_module(model)), then create the optimizer and call fabric.setup_optimizers()."
                )
        module = self.setup_module(module)
        sharded = dict(module.named_parameters(remove_duplicate=False))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                try:
                    group["params"] = [sharded[names[id(p)]] for p in group["params"]]
                except KeyError:
                    raise OverlapConfigError(
                        "fsdp_overlap: the optimizer holds a tensor that is not a parameter of the model given "
                        "to fabric.setup(); create the optimizer after fabric.setup_module(model)."
                    ) from None
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    # ---------------------------------------------------------------- training
    @override
    def backward(self, tensor: Any, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]
        if self.schedule_report is None and self._parallelized is not None:
            self.schedule_report = schedule_report(self._parallelized)
            self.schedule_metrics = report_metrics(self.schedule_report)
            if self.global_rank == 0:
                self._log.info(format_report(self.schedule_report))

    # ------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, path: Any, state: dict, storage_options: Any = None, filter: Any = None) -> None:
        """Fabric's save, written beside ``path`` and renamed into place once every rank
        has written: a kill mid-save leaves the previous checkpoint of that name, complete."""
        if self._parallelized is not None and not self._sharded_checkpoints:
            refuse_tensor_parallel_checkpoint(self._parallelized, "Fabric checkpoint save (state_dict_type='full')")
        path = Path(self.broadcast(path))
        with saved_atomically(path, state.get("step")) as partial, no_gathers():
            super().save_checkpoint(partial, state, storage_options=storage_options, filter=filter)  # type: ignore[misc]

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = Path(self.broadcast(path))
        if self._parallelized is not None and not path.is_dir():  # a full checkpoint file: not tested yet
            refuse_tensor_parallel_checkpoint(self._parallelized, f"Fabric checkpoint load of the full file {path}")
        check_loadable(path)  # an incomplete folder is named, with the newest complete one beside it
        with no_gathers():
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)  # type: ignore[misc]


class FSDPOverlapFabricStrategy(FabricStrategyMixin, ModelParallelStrategy):
    __doc__ = FabricStrategyMixin.__doc__
    _lightning_package = "lightning.fabric"
