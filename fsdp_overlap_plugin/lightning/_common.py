"""What the Lightning adapters share, without a Lightning base class: the precision mapping,
the config a strategy is built from (completed once, when Lightning configures the
launcher), which module is parallelized (and parallelizing it once), the members and hooks
both strategies have, the device helpers, and the schedule report as metrics.

Both the Trainer strategy and the Fabric strategy exist twice (for the ``lightning``
package and for the standalone ``pytorch_lightning`` / ``lightning_fabric`` packages,
whose class hierarchies and registries are separate), so everything that does not need
a Lightning base class lives here.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.nn as nn
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from .._lightning_compat import (
    base_configure_launcher,
    base_setup_distributed,
    private_hook,
    process_group_backend,
    process_group_timeout,
)
from ..config.keys import suggest, unknown_key_message
from ..config.schema import OverlapConfig, OverlapConfigError
from ..core import (
    check_complete,
    devices,
    get_state,
    install_excepthook,
    is_sharded,
    materialize,
    parallelize,
    pop_compile_notes,
    retire,
    take_over_compiled,
    written_atomically,
)
from ._mesh import SHARDING_STRATEGIES, check_mesh_arguments, mesh_from_arguments, resolve_mesh

__all__ = [
    "CONFIG_FIELDS",
    "PRECISION_DTYPES",
    "StrategyBase",
    "SHARDING_STRATEGIES",
    "align_autocast_device",
    "build_config",
    "check_mesh_arguments",
    "LIGHTNING_MESH_NAMES",
    "checked_arguments",
    "config_for_precision",
    "distributed_checkpoint",
    "log_once",
    "mesh_from_arguments",
    "no_gathers",
    "on_meta",
    "parallelize_once",
    "parallelized_module",
    "precision_of",
    "report_metrics",
    "resolve_mesh",
    "select_target",
    "warn_if_npu_unused",
]

# The OverlapConfig keys. The strategies spell each out as a keyword argument (LightningCLI
# accepts only named parameters as init_args); tests/lightning/test_lightning.py checks that their
# signatures cover every key, so a key added to OverlapConfig cannot be forgotten there.
CONFIG_FIELDS = tuple(OverlapConfig.field_docs())

# Lightning precision flag -> (default param_dtype, default reduce_dtype,
#                              allowed param_dtype, allowed reduce_dtype).
# None means "the parameter's own dtype" (fp32 under 32-true). "-mixed" keeps Lightning's
# autocast around the step and gathers parameters in the low dtype, so matmuls read half
# the bytes and autocast still runs norms, softmax and the loss in fp32; gradients are
# reduced in fp32 unless the config asks for less. "-true" casts the module (so the
# shards, i.e. the master weights, are in that dtype) before it is sharded.
# The flags are those Lightning's ModelParallelStrategy supports: "16-mixed" needs a
# GradScaler over sharded gradients, which neither Lightning nor we support there (on a
# CPU Lightning turns it into "bf16-mixed" itself).
PRECISION_DTYPES: dict[str, tuple[str | None, str | None, tuple, tuple]] = {
    "32-true": (None, None, (None, "fp32"), (None, "fp32", "bf16", "fp16")),
    "bf16-mixed": ("bf16", "fp32", ("bf16", "fp32"), ("fp32", "bf16")),
    "bf16-true": ("bf16", "bf16", ("bf16",), ("bf16", "fp32")),
    "16-true": ("fp16", "fp16", ("fp16",), ("fp16", "fp32")),
}

_SUGGESTED_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-true", "fp32": "32-true"}


def precision_of(plugin: Any) -> str:
    """The precision flag a Lightning/Fabric precision plugin was built for."""
    return str(getattr(plugin, "precision", "32-true"))


_Init = TypeVar("_Init", bound=Callable[..., None])


def checked_arguments(init: _Init) -> _Init:
    """Wrap a strategy's ``__init__`` so that a keyword it does not take is an
    ``OverlapConfigError`` naming the class the user wrote, the keyword, the nearest valid
    one and where the list is, instead of Python's ``TypeError`` naming our mixin. Raised
    before any process group, it is printed once under torchrun (``messages``).

    ``functools.wraps`` keeps the signature (``inspect.signature`` follows ``__wrapped__``),
    which is what LightningCLI/jsonargparse, Lightning's registry and type checkers read."""
    parameters = inspect.signature(init).parameters
    valid = [n for n, p in parameters.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    own = [n for n in valid if n not in CONFIG_FIELDS]

    @functools.wraps(init)
    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            install_excepthook()  # uncaught, it is printed once and short
            raise OverlapConfigError(
                unknown_key_message(
                    unknown[0],
                    valid,
                    source=type(self).__name__,
                    what="argument",
                    tail=f"Its arguments are the config keys of docs/config.md and {', '.join(own)}.",
                )
            )
        init(self, *args, **kwargs)

    if hasattr(checked.__code__, "co_qualname"):  # Python 3.11+
        # what a configuration error raised in the constructor says it was raised in
        checked.__code__ = checked.__code__.replace(co_qualname=init.__qualname__)
    return checked  # type: ignore[return-value]


def build_config(config: OverlapConfig | dict | str | None, overrides: dict[str, Any]) -> OverlapConfig:
    """The user's config: a file/dict/object plus keyword arguments that are not None.

    Validated here, at construction, so a wrong value fails before any process starts
    (and, uncaught, is printed once and short: ``messages.install_excepthook``). A wrong
    keyword never gets here: ``checked_arguments`` refuses it.
    """
    install_excepthook()
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return OverlapConfig.coerce(config, **given)  # once: the file/dict and the keywords together
    except OverlapConfigError as exc:
        error = exc
    # Which part is wrong: coerce reads ``config`` first, so when ``config`` alone fails,
    # that is the error raised, named as the strategy's ``config`` argument.
    try:
        OverlapConfig.coerce(config)
    except OverlapConfigError as base_error:
        raise OverlapConfigError(f"config: {base_error}") from None
    raise error


#: The mesh's dimensions as Lightning's ModelParallelStrategy names them (with tensor parallelism)
LIGHTNING_MESH_NAMES = {"shard": "data_parallel", "tensor": "tensor_parallel"}

STATE_DICT_TYPES = ("full", "sharded")


def distributed_checkpoint(save_distributed_checkpoint: bool | None, state_dict_type: str | None) -> bool:
    """Whether checkpoints are sharded, from ``ModelParallelStrategy``'s
    ``save_distributed_checkpoint`` or the ``state_dict_type`` of Lightning's FSDP
    strategies (``"full"``: one file with the gathered state on rank 0; ``"sharded"``: a
    distributed-checkpoint directory, the default). Both given must agree."""
    if state_dict_type is not None and state_dict_type not in STATE_DICT_TYPES:
        raise OverlapConfigError(
            f"state_dict_type: {state_dict_type!r} is not one of {', '.join(STATE_DICT_TYPES)}."
            f"{suggest(str(state_dict_type), STATE_DICT_TYPES)}"
        )
    if state_dict_type is None:
        return True if save_distributed_checkpoint is None else bool(save_distributed_checkpoint)
    sharded = state_dict_type == "sharded"
    if save_distributed_checkpoint is not None and bool(save_distributed_checkpoint) != sharded:
        raise OverlapConfigError(
            f"state_dict_type={state_dict_type!r} contradicts save_distributed_checkpoint="
            f"{save_distributed_checkpoint!r}: they say the same thing, pass one of them."
        )
    return sharded


def config_for_precision(config: OverlapConfig, precision: str) -> OverlapConfig:
    """Fill ``param_dtype`` / ``reduce_dtype`` from Lightning's precision flag.

    A dtype the user set explicitly wins when it is compatible with the precision (e.g.
    ``reduce_dtype: bf16`` under ``bf16-mixed``); one that contradicts it (``param_dtype:
    bf16`` under ``32-true``) is an error naming both, never silently overridden.
    """
    if precision not in PRECISION_DTYPES:
        raise OverlapConfigError(
            f"precision={precision!r} is not supported by the fsdp_overlap strategy; "
            f"valid: {', '.join(PRECISION_DTYPES)}.{suggest(precision, list(PRECISION_DTYPES))}"
        )
    default_param, default_reduce, allowed_param, allowed_reduce = PRECISION_DTYPES[precision]
    changes: dict[str, Any] = {}
    for key, default, allowed in (
        ("param_dtype", default_param, allowed_param),
        ("reduce_dtype", default_reduce, allowed_reduce),
    ):
        value = getattr(config, key)
        if value is None:
            changes[key] = default
        elif value not in allowed:
            hint = _SUGGESTED_PRECISION.get(value) if key == "param_dtype" else None
            fix = f"set precision={hint!r} on the Trainer/Fabric, or " if hint and hint != precision else ""
            valid = ", ".join("null" if a is None else a for a in allowed)
            raise OverlapConfigError(
                f"{key}: {value!r} conflicts with precision={precision!r} (valid there: {valid}). "
                f"Either {fix}remove {key} from the fsdp_overlap config."
            )
    if all(getattr(config, k) == v for k, v in changes.items()):
        return config
    return config.replace(**changes)


def select_target(root: nn.Module, spec: str) -> tuple[str, nn.Module]:
    """The module to parallelize inside a LightningModule: ``(fqn, module)``.

    ``"auto"``: the one child that holds all the parameters (``self.model = GPT()``), so
    both ``self(x)`` and ``self.model(x)`` run the compiled forward and plans are written
    relative to the model, as for ``parallelize(model)``; otherwise the LightningModule
    itself (its ``forward`` is compiled: call ``self(x)`` in ``training_step``).
    ``""`` always means the LightningModule; any other string is a submodule FQN.
    """
    if spec == "auto":
        if any(p is not None for p in root._parameters.values()):
            return "", root
        holders = [(name, child) for name, child in root.named_children() if any(True for _ in child.parameters())]
        return holders[0] if len(holders) == 1 else ("", root)
    if spec == "":
        return "", root
    names = [name for name, _ in root.named_modules() if name]
    if spec not in names:
        raise OverlapConfigError(
            f"module: {type(root).__name__} has no submodule {spec!r}.{suggest(spec, names)} "
            'Use "auto", "" (the LightningModule itself) or a submodule name.'
        )
    return spec, root.get_submodule(spec)


def on_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def parallelized_module(root: nn.Module) -> nn.Module | None:
    """The module ``parallelize`` already ran on inside ``root`` (by a strategy on an
    earlier ``fit``/``validate``, or by the user inside ``configure_model``), or None."""
    for module in root.modules():
        if get_state(module) is not None:
            return module
    return root if is_sharded(root) else None


def parallelize_once(
    root: nn.Module,
    choose_target: Callable[[], nn.Module],
    config: OverlapConfig,
    mesh: Any,
    device: torch.device,
) -> nn.Module:
    """Parallelize the module ``choose_target()`` names inside ``root``, unless one
    already was, then materialize ``root`` if it was built on the meta device (initialised
    as its library does; a tensor nothing initialises is an error or a warning, per
    ``on_uninitialized``). Returns the parallelized module."""
    done = parallelized_module(root)
    if done is None:
        # a compiled child (self.model = torch.compile(model)) is replaced on its parent by
        # the module inside, before the target is chosen; the root itself never is a wrapper
        # (Lightning and Fabric take theirs off first)
        take_over_compiled(root)
        target = choose_target()
        if not on_meta(root):
            root.to(device)
        parallelize(target, config, mesh=mesh)
        state = get_state(target)
        if state is not None and target is not root:
            state.adjustments[:0] = pop_compile_notes(root)
        done = target
    if on_meta(root):
        materialize(root, device, on_uninitialized=config.on_uninitialized)
    return done


class StrategyBase:
    """The members the Trainer and Fabric strategy mixins have in common. A subclass sets
    ``_user_config`` / ``_config`` and ``_lightning_package`` and says its precision flag
    (``_precision_flag``); the Lightning base class provides ``root_device``,
    ``world_size``, ``global_rank`` and the process-group arguments (``_lightning_compat``)."""

    _lightning_package: str
    _user_config: OverlapConfig
    _config: OverlapConfig | None

    _sharding_strategy: Any = None
    _mesh_sizes: Any = None
    _tensor_parallel_arg: int = 1
    _data_parallel_arg: Any = "auto"
    #: The config completed when Lightning configured the launcher (``_configure_launcher``).
    _completed: OverlapConfig | None = None

    def _precision_flag(self) -> str:
        raise NotImplementedError  # the Trainer's precision plugin, or Fabric's

    def _init_mesh_arguments(
        self, sharding_strategy: Any, device_mesh: Any, tensor_parallel_size: Any = 1, data_parallel_size: Any = "auto"
    ) -> None:
        """Keep Lightning's mesh spellings (checked now; resolved once the node count is
        known, ``_config_with_mesh``)."""
        try:
            check_mesh_arguments(
                self._user_config, sharding_strategy, device_mesh, tensor_parallel_size, data_parallel_size
            )
        except OverlapConfigError:
            install_excepthook()
            raise
        self._sharding_strategy = sharding_strategy
        self._mesh_sizes = device_mesh
        self._tensor_parallel_arg = tensor_parallel_size
        self._data_parallel_arg = data_parallel_size

    def _config_with_mesh(self) -> OverlapConfig:
        """The user's config with ``mesh`` set from ``sharding_strategy`` / ``device_mesh``
        and Lightning's ``num_nodes`` / ``devices`` (``resolve_mesh``, whose argument checks
        ran at construction)."""
        devices = len(getattr(self, "parallel_devices", None) or []) or 1
        nodes = int(getattr(self, "num_nodes", 1))
        config = mesh_from_arguments(
            self._user_config, self._sharding_strategy, self._mesh_sizes, nodes, devices, self._tensor_parallel_arg
        )
        dp = self._data_parallel_arg
        if dp != "auto" and dp * config.mesh.tensor != nodes * devices:
            raise OverlapConfigError(
                f"data_parallel_size={dp} x tensor_parallel_size={config.mesh.tensor} = {dp * config.mesh.tensor} "
                f"ranks, but the job has {nodes * devices} (num_nodes={nodes} x devices={devices}); their product "
                "must be the world size (or leave data_parallel_size='auto')."
            )
        return config

    def _complete_config(self) -> OverlapConfig:
        """The user's config completed from Lightning's arguments: the mesh, then the dtypes
        from the precision flag (``config_for_precision``). Pure: every rank raises the same error."""
        return config_for_precision(self._config_with_mesh(), self._precision_flag())

    @private_hook
    def _configure_launcher(self) -> None:
        # The last hook Lightning calls while building the Trainer / Fabric, with the precision
        # plugin, devices and node count attached: the config is completed here, once, so a
        # precision conflict fails at Trainer(...), before any process is launched.
        self._completed = self._complete_config()
        base_configure_launcher(StrategyBase, self)

    def _config_for_setup(self) -> OverlapConfig:
        """Put the completed config in force (``setup_environment``): the one completed at
        ``_configure_launcher``, or completed now for a strategy Lightning did not configure."""
        self._config = self._completed if self._completed is not None else self._complete_config()
        return self._config

    @property
    def overlap_config(self) -> OverlapConfig:
        """The config in force: the user's, completed from the precision once set up."""
        return self._config or self._user_config

    @property
    def _log(self) -> logging.Logger:
        # A child of Lightning's logger, so messages reach the console like Lightning's own.
        return logging.getLogger(f"{self._lightning_package}.strategies.fsdp_overlap")

    @private_hook
    def _get_process_group_backend(self) -> str:
        return process_group_backend(self) or devices.backend_for(self.root_device.type)  # type: ignore[attr-defined]

    @private_hook
    def _setup_distributed(self) -> None:
        """Lightning's (seed, ranks, process group), except that a job torchrun restarted
        gets its process group on a store namespace of its own (``devices.init_process_group``):
        with Lightning's, a restarted rank can read a peer's address from the killed attempt
        and fail with ``Gloo connectFullMesh failed ... Connection refused``. Lightning then
        finds the group initialised and keeps it."""
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:
            device = self.root_device  # type: ignore[attr-defined]
            devices.init_process_group(
                self._get_process_group_backend(),
                timeout=process_group_timeout(self),
                device_id=device if device.type != "cpu" else None,
            )
        base_setup_distributed(StrategyBase, self)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel rank (also on an HSDP mesh): each reads its own data;
        # with tensor parallelism the ranks of one tensor-parallel group (consecutive ranks,
        # the mesh's innermost dimension) read the same data.
        tensor = self.overlap_config.mesh.tensor
        return {"num_replicas": self.world_size // tensor, "rank": self.global_rank // tensor}  # type: ignore[attr-defined]


def align_autocast_device(plugin: Any, device: torch.device) -> None:
    """Point a Lightning/Fabric mixed-precision plugin at ``device``'s type if Lightning
    chose "cuda" for an accelerator it does not know (an NPU)."""
    if device.type not in ("cpu", "cuda") and getattr(plugin, "device", None) == "cuda":
        plugin.device = device.type


def warn_if_npu_unused(device: torch.device) -> None:
    """Lightning's ``accelerator="auto"`` does not know NPUs; say so instead of training
    on the CPU of an NPU machine without a word."""
    if device.type == "cpu" and devices.npu_module() is not None and devices.detect_device_type() == "npu":
        rank_zero_warn(
            "fsdp_overlap: an Ascend NPU is available but this run uses the CPU. Lightning's "
            "accelerator='auto' does not detect NPUs: pass accelerator='npu'."
        )


def report_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The schedule report as flat numbers, for ``self.log_dict`` and loggers."""
    metrics: dict[str, float] = {
        "fsdp_overlap/buckets": float(len(report["plan"])),
        "fsdp_overlap/world_size": float(report["world_size"]),
        "fsdp_overlap/unbucketed_params": float(len(report.get("unbucketed_params") or [])),
    }
    for kind in ("forward", "backward"):
        record = report.get(kind)
        if not record:
            continue
        for key in ("all_gather", "reduce_scatter", "all_reduce"):
            for when in ("before", "after"):
                metrics[f"fsdp_overlap/{kind}_{key}s_{when}"] = float(record[when].get(key, 0))
    return metrics


_LOGGED: set[str] = set()


def log_once(logger: logging.Logger, key: str, message: str) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(message)


@contextmanager
def no_gathers() -> Iterator[None]:
    """State-dict and checkpoint code reads parameters through ``getattr`` (torch's DCP
    ``_get_fqns`` does); inside this block that returns the shard instead of running an
    all-gather per parameter."""
    from ..core import gather_disabled

    with gather_disabled():
        yield


# What a sharded Lightning checkpoint folder needs besides the shards: DCP's index and
# rank 0's ``meta.pt`` (loop, callbacks, the rest of the checkpoint dict).
LIGHTNING_FOLDER = (".metadata", "meta.pt")


@contextmanager
def saved_atomically(path: Any, step: Any = None) -> Iterator[Any]:
    """Lightning's save of ``path`` (every rank calls it with the same path), written to a
    hidden sibling and renamed into place once every rank has written
    (``shard/atomic_checkpoint.py``): the name holds the old complete checkpoint or the
    new one, never a mix. Yields the path to hand to Lightning's own save."""
    with written_atomically(path, step=step if isinstance(step, int) else None) as partial:
        yield partial


def check_loadable(path: Any) -> None:
    """Before Lightning loads ``path``: on every rank, ``IncompleteCheckpointError``
    naming what is missing and the newest complete checkpoint beside it."""
    check_complete(path, required=LIGHTNING_FOLDER)


def remove_local_checkpoint(path: Any) -> bool:
    """Remove a local checkpoint so that no half-deleted one stays under its name; False
    for a remote (fsspec URL) path, which Lightning's checkpoint IO removes."""
    if "://" in str(path):
        return False
    retire(path)
    return True
