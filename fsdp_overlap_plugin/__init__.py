"""fsdp-overlap: FSDP2 sharding that torch.compile can see, plus passes that hide its
communication behind compute. Public API only; see docs/architecture.md."""

from __future__ import annotations

from ._version import __version__, check_torch_version
from .config.plan import PlanWarning, auto_plan, resolve_plan
from .config.schema import MeshConfig, OverlapConfig, OverlapConfigError
from .parallelize import parallelize
from .report.schedule import format_report, schedule_report
from .runtime.devices import init_process_group
from .shard.atomic_checkpoint import IncompleteCheckpointError
from .shard.export import full_state_dict, save_pretrained
from .shard.initialize import UninitializedWarning, materialize
from .shard.sharding import gather_disabled
from .shard.weights import load_pretrained

check_torch_version()

# Lightning has no entry-point discovery: registering "fsdp_overlap" (and "npu" when
# torch_npu imports) in every installed Lightning registry happens on import.
from .lightning.register import register as _register_lightning  # noqa: E402

_register_lightning()

__all__ = [
    "IncompleteCheckpointError",
    "MeshConfig",
    "OverlapConfig",
    "OverlapConfigError",
    "PlanWarning",
    "UninitializedWarning",
    "__version__",
    "auto_plan",
    "format_report",
    "full_state_dict",
    "gather_disabled",
    "init_process_group",
    "load_pretrained",
    "materialize",
    "parallelize",
    "resolve_plan",
    "save_pretrained",
    "schedule_report",
]
