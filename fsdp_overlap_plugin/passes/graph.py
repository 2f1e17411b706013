"""Shared FX predicates: collectives, waits, views, barriers, groups, module paths.

Every pass asks these questions the same way, so a graph the bucketing pass rewrote
(waits possibly wrapped in ``control_deps``) reads the same to the gradient-overlap
pass. Nothing here touches a process group or a tensor value.
"""

from __future__ import annotations

import functools
import operator
import re
from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from .. import _torch_compat as compat
from ..contract import PARAM_KEY
from .ops import FILL_SLOT, PACK_ROWS

__all__ = [
    "C10D",
    "collective_counts",
    "data_inputs",
    "data_users",
    "collective_of_wait",
    "effective_target",
    "graph_kind",
    "group_name",
    "is_all_gather",
    "is_all_reduce",
    "is_barrier",
    "is_collective",
    "is_control_deps",
    "is_fsdp_all_gather",
    "is_fsdp_reduce_scatter",
    "is_preparation_op",
    "is_reduce_scatter",
    "is_view",
    "is_wait",
    "mark_tensor_parallel",
    "size_hint",
    "merge_duplicate_waits",
    "numel_hint",
    "module_path",
    "dynamo_module_path",
    "node_args",
    "owner_module",
    "param_fqn",
    "PARAM_KEY",
    "TENSOR_PARALLEL_KEY",
    "wait_of",
]

#: ``node.meta`` key of a collective on a tensor-parallel group (``mark_tensor_parallel``):
#: the plan's, never a parameter gather or a gradient reduction, whatever its shape
TENSOR_PARALLEL_KEY = "fsdp_overlap_tensor_parallel"

C10D = torch.ops._c10d_functional
_COMM_NAMESPACES = ("_c10d_functional", "c10d_functional")
_ALL_GATHERS = (C10D.all_gather_into_tensor.default, C10D.all_gather_into_tensor_out.default)


# Every predicate below is asked of every node by several passes (and twice more by the
# compile wiring's schedule events and collective counts), so what depends only on a
# node's target is decided once per target, not once per node: for an ATen overload that
# is a string and schema inspection, for ``control_deps`` an import lookup. The tables are
# keyed by ``id(target)`` and hold the target itself (so the id cannot be reused): an
# ``OpOverload``'s ``__hash__`` is Python code, which a ``functools.cache`` would call on
# every lookup.


def size_hint(size: Any) -> int:
    """An int, or the value a symbolic size (a dynamic sequence length) had when Dynamo
    traced the graph, read without guarding on it: ``int()`` of a ``SymInt`` would add a
    guard that specialises the graph to that one value (one recompile per length). For
    estimates (bytes, FLOPs) only; an unbacked size with no hint counts as 0."""
    if isinstance(size, (torch.SymInt, torch.SymFloat)):
        hint = size.node.hint
        if hint is None:
            return 0
        return int(hint)
    return int(size)


def numel_hint(val: Any) -> int:
    """``val.numel()`` of a (fake) tensor, symbolic sizes at their hints, without guarding."""
    count = 1
    for size in val.shape:
        count *= size_hint(size)
    return count


def _per_target(table: dict[int, tuple[Any, Any]], decide: Any, target: Any) -> Any:
    entry = table.get(id(target))
    if entry is None:
        entry = table[id(target)] = (target, decide(target))
    return entry[1]


@functools.cache
def _control_deps_op() -> Any:
    return compat.control_deps_op()


def is_control_deps(node: fx.Node) -> bool:
    """A ``control_deps`` wrapper (inserted to pin an order) around one operation."""
    if node.op != "call_function":
        return False
    control_deps = _control_deps_op()
    return control_deps is not None and node.target is control_deps


def _wrapped_target(node: fx.Node) -> Any:
    sub = node.args[1]
    gm = node.graph.owning_module
    if isinstance(sub, fx.Node) and sub.op == "get_attr" and gm is not None:
        module = getattr(gm, str(sub.target), None)
        if isinstance(module, fx.GraphModule):
            for inner in module.graph.nodes:
                if inner.op == "call_function":
                    return inner.target
    return None


def effective_target(node: fx.Node) -> Any:
    """The operation a node runs, looking through a ``control_deps`` wrapper."""
    if node.op != "call_function":
        return None
    target = node.target
    control_deps = _control_deps_op()
    return _wrapped_target(node) if control_deps is not None and target is control_deps else target


def node_args(node: fx.Node) -> tuple:
    """Positional arguments of the operation (without a ``control_deps`` wrapper's own)."""
    if is_control_deps(node):
        return tuple(node.args[2:])
    return tuple(node.args)


def _namespace(target: Any) -> str:
    return getattr(target, "namespace", "") or ""


# what a target is, for communication: not communication, a wait, or a collective launch
_NOT_COMM, _WAIT, _LAUNCH = 0, 1, 2


def _classify(target: Any) -> int:
    if _namespace(target) not in _COMM_NAMESPACES:
        return _NOT_COMM
    return _WAIT if "wait_tensor" in str(target) else _LAUNCH


_COMM_KINDS: dict[int, tuple[Any, int]] = {}


def _comm_kind(target: Any) -> int:
    return _per_target(_COMM_KINDS, _classify, target)


def is_wait(node: fx.Node) -> bool:
    return _comm_kind(effective_target(node)) == _WAIT


def is_collective(node: fx.Node) -> bool:
    """A collective launch (all-gather, reduce-scatter, all-reduce, ...), not a wait."""
    return _comm_kind(effective_target(node)) == _LAUNCH


_REDUCE_SCATTER = C10D.reduce_scatter_tensor.default
_ALL_REDUCE = C10D.all_reduce.default


def is_all_gather(node: fx.Node) -> bool:
    target = effective_target(node)
    return target is _ALL_GATHERS[0] or target is _ALL_GATHERS[1]


def is_reduce_scatter(node: fx.Node) -> bool:
    return effective_target(node) is _REDUCE_SCATTER


def is_all_reduce(node: fx.Node) -> bool:
    return effective_target(node) is _ALL_REDUCE


def collective_of_wait(wait: fx.Node) -> fx.Node | None:
    """The collective a wait waits on (through a ``getitem`` for coalesced collectives)."""
    args = node_args(wait)
    if not args or not isinstance(args[0], fx.Node):
        return None
    src = args[0]
    if src.op == "call_function" and src.target is operator.getitem:
        src = src.args[0]
    return src if isinstance(src, fx.Node) and is_collective(src) else None


def wait_of(collective: fx.Node) -> fx.Node | None:
    """The single wait of a collective, or None if it has none or several."""
    waits = [u for u in data_users(collective) if is_wait(u)]
    return waits[0] if len(waits) == 1 else None


def merge_duplicate_waits(graph: fx.Graph) -> int:
    """Give every collective a single wait: a collective waited on twice (AOT autograd's
    CSE merges identical reduce-scatters, e.g. of two biases whose gradients are the same
    tensor, but not their waits) keeps its first wait, and users of the others read it.
    Waiting is idempotent, and the first wait precedes every later one's users, so nothing
    computed changes. Returns how many waits were removed."""
    removed = 0
    order: dict[fx.Node, int] = {}  # graph positions, numbered once (erasing keeps the others' order)
    for node in list(graph.nodes):
        if not is_collective(node):
            continue
        waits = [u for u in node.users if is_wait(u) and not is_control_deps(u)]
        if len(waits) < 2:
            continue
        order = order or {n: i for i, n in enumerate(graph.nodes)}
        first, *rest = sorted(waits, key=order.__getitem__)
        for wait in rest:
            wait.replace_all_uses_with(first)
            graph.erase_node(wait)
            removed += 1
    return removed


def group_name(node: fx.Node) -> Any:
    """The process-group name of a collective (its last positional argument)."""
    args = node_args(node)
    name = node.kwargs.get("group_name", args[-1] if args else None)
    if isinstance(name, fx.Node):  # compile-on-one-rank graphs pass the group as a node
        val = name.meta.get("val")
        return getattr(val, "group_name", name.name)
    return name


def is_view(node: fx.Node) -> bool:
    """An operation whose output aliases its input (no data is computed or copied)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and is_view(src)
    if isinstance(target, compat.OpOverload):
        return _per_target(_VIEWS, _overload_is_view, target)
    return False


_VIEWS: dict[int, tuple[Any, bool]] = {}


def _overload_is_view(target: compat.OpOverload) -> bool:
    # the op's schema decides, so once per op
    if getattr(target, "is_view", False):
        return True
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not _mutates(target)


# Copies that keep every element where it is (a view does too, without copying).
_COPIES = (torch.ops.aten.clone.default, torch.ops.aten.contiguous.default, torch.ops.aten._unsafe_view.default)


def is_selection(node: fx.Node) -> bool:
    """A view or a copy of its input: it only selects elements, so an elementwise
    collective (all-reduce, the sum inside a reduce-scatter) commutes with it."""
    return node.op == "call_function" and (is_view(node) or node.target in _COPIES)


_PREPARATION_OPS = {
    FILL_SLOT,  # a merged all-gather's copy-in (ops.py)
    PACK_ROWS,  # a merged reduce-scatter's copy-in
    torch.ops.aten.cat.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.constant_pad_nd.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.prims.convert_element_type.default,
    operator.getitem,
}


# by identity (an OpOverload's hash is Python code): the ops above are alive as long as the set
_PREPARATION_IDS = frozenset(id(op) for op in _PREPARATION_OPS)


def is_preparation_op(node: fx.Node) -> bool:
    """Data movement that only lays out a collective's input: views, padding,
    concatenation, dtype casts, copies to contiguous memory, a merged bucket's copy-in."""
    return node.op == "call_function" and (is_view(node) or id(node.target) in _PREPARATION_IDS)


def _mutates(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def is_barrier(node: fx.Node) -> bool:
    """A node nothing may be moved across: graph inputs/outputs, mutation, side effects.

    Collectives and waits are not barriers here: each pass decides which of them it
    owns and which it must respect (an unowned collective on the same group is a
    barrier for launches; see the passes).
    """
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op != "get_attr"
    if node.op != "call_function":
        return True
    if is_collective(node) or is_wait(node):
        return False
    if is_control_deps(node):
        return True  # an order someone pinned on purpose
    target = node.target
    if isinstance(target, compat.OpOverload):
        return _per_target(_BARRIERS, _overload_is_barrier, target)
    if target is operator.getitem:
        return False
    try:
        return node.is_impure(impure_random=False)
    except Exception:  # pragma: no cover - defensive: unknown targets are barriers
        return True


_BARRIERS: dict[int, tuple[Any, bool]] = {}


def _overload_is_barrier(target: compat.OpOverload) -> bool:
    # For an ATen overload, mutation and side effects depend on the op alone (its
    # schema and registrations), so decide once per op, not once per node. Random ops
    # are not barriers: moving other nodes across them consumes no random numbers.
    if _mutates(target):
        return True
    return compat.is_impure(target)


# A Dynamo source's root: the frame's local (``L['self']``, ``L['args'][0]``, ``L['fn']``)
# with any subscripts directly on it; or a global (``G['model']``).
_ROOT = re.compile(r"""^[LG]\[(?:'[^']*'|"[^"]*")\](?:\[(?:'[^']*'|"[^"]*"|\d+)\])*""")
_ITEM = re.compile(r"""\[(?:'([^']*)'|"([^"]*)"|(\d+))\]""")
_CLEAN = re.compile(r"^[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*$|^$")


@functools.lru_cache(maxsize=65536)
def clean_module_path(stack_key: str) -> str | None:
    """``L['self'].blocks.0.ln`` / ``L['args'][0]._modules['blocks']['0']`` -> ``blocks.0.ln``.

    Works whatever the compiled root is called (``self``, ``args[0]`` when a decorator
    takes the module through ``*args``, ``fn``, ...). Returns None for a source that is
    not a chain of attributes from the root (``dict(type(L['self'].emb).__dict__)['w']
    .fget.__closure__[0].cell_contents``: a helper module reached through a parameter
    property, as torchtitan's SimpleFSDP does).
    """
    match = _ROOT.match(stack_key)
    if match is None:
        return None
    path = stack_key[match.end() :].replace("._modules", "")
    path = _ITEM.sub(lambda m: "." + (m.group(1) or m.group(2) or m.group(3)), path).strip(".")
    return path if _CLEAN.match(path) else None


def _stack(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return []
    return [value[0] if isinstance(value, tuple) else str(value) for value in stack.values()]


def dynamo_module_path(node: fx.Node) -> str | None:
    """The innermost module source exactly as Dynamo recorded it (for messages)."""
    stack = _stack(node)
    return stack[-1] if stack else None


def module_path(node: fx.Node) -> str | None:
    """The innermost module path a node was traced in, relative to the compiled root.

    Forward (and recomputed) nodes carry ``nn_module_stack``; backward nodes carry
    ``fwd_nn_module_stack``. Entries whose source is not a plain attribute chain from
    the root (a module reached through a closure) are skipped in favour of the nearest
    enclosing one. Bucketed nodes keep the first source's stack. None when the node has
    no module information at all.
    """
    for key in reversed(_stack(node)):
        path = clean_module_path(key)
        if path is not None:
            return path
    return None


def param_fqn(node: fx.Node) -> str | None:
    """The FQN of the parameter whose gather made ``node`` (see ``PARAM_KEY``), or None."""
    custom = node.meta.get("custom")
    return custom.get(PARAM_KEY) if isinstance(custom, dict) else None


def owner_module(node: fx.Node) -> str | None:
    """The module that owns a collective, for plan lookups: the module holding the
    parameter when the node carries its FQN (exact, whatever Dynamo calls the root or
    the frame), else the module path Dynamo recorded (graphs traced by other code)."""
    fqn = param_fqn(node)
    if fqn is not None:
        return fqn.rsplit(".", 1)[0] if "." in fqn else ""
    return module_path(node)


# How many layout-only nodes ``_built_from_inputs`` walks back from an all-gather's input
# before it gives up. A shard reaches its all-gather through a handful (cast, padding,
# views); a bucket of shards through about two per shard plus one concatenation, so 4096
# covers buckets of well over a thousand parameters. The bound keeps the test, asked of
# every all-gather by several passes, from walking a whole graph; past it the all-gather
# is not taken for a parameter gather (ours carry their FQN and never need the walk).
_INPUT_WALK_LIMIT = 4096
# How many nodes ``_reduced`` walks back from one operand of a sum to its reduce-scatters:
# a wait, a few views or casts (and on HSDP an all-reduce and its wait) per use of a
# parameter, times the few uses a tied parameter has.
_REDUCED_WALK_LIMIT = 64


def _built_from_inputs(node: fx.Node, limit: int = _INPUT_WALK_LIMIT) -> bool:
    """True if ``node`` is made from graph inputs by layout-only operations (views,
    casts, padding, concatenation): a parameter shard, or a bucket of them."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur in seen or cur.op == "placeholder":
            continue
        if len(seen) >= limit or not is_preparation_op(cur):
            return False
        seen.add(cur)
        stack.extend(data_inputs(cur))
    return True


def mark_tensor_parallel(graph: fx.Graph, groups: Any) -> int:
    """Mark the collectives on ``groups`` (the tensor-parallel groups' names, which the
    caller resolved) as the plan's (``TENSOR_PARALLEL_KEY``); returns how many. Sequence
    parallelism's forward reduce-scatters are saved for the backward, so the forward graph
    returns them as it returns a gradient reduction: only the group tells them apart."""
    marked = 0
    for node in graph.nodes:
        if is_collective(node) and group_name(node) in groups:
            node.meta[TENSOR_PARALLEL_KEY] = True
            marked += 1
    return marked


def is_fsdp_all_gather(node: fx.Node) -> bool:
    """An all-gather of parameter shards: one our sharding traced (it carries the
    parameter's FQN), or one whose input is built from graph inputs by layout-only
    operations (a shard, its dtype cast or padding, or a bucket of shards). A
    tensor-parallel all-gather of computed activations does not qualify, nor one marked
    tensor-parallel (``mark_tensor_parallel``)."""
    if not is_all_gather(node) or node.meta.get(TENSOR_PARALLEL_KEY):
        return False
    if param_fqn(node) is not None:
        return True
    source = node_args(node)[0]
    return isinstance(source, fx.Node) and _built_from_inputs(source)


def data_inputs(node: fx.Node) -> list[fx.Node]:
    """Inputs a node computes with; a ``control_deps`` wrapper's ordering-only
    dependencies are not among them."""
    if is_control_deps(node):
        return [a for a in node_args(node) if isinstance(a, fx.Node)]
    return node.all_input_nodes


def data_users(node: fx.Node) -> list[fx.Node]:
    """Users that compute with ``node`` (not those that only wait for it to be ordered)."""
    return [u for u in node.users if not is_control_deps(u) or node in data_inputs(u)]


def is_fsdp_reduce_scatter(node: fx.Node) -> bool:
    """A gradient reduce-scatter: one our sharding traced (it carries the parameter's
    FQN), or one whose reduced result is returned by the graph through single-input
    operations (wait, views, casts, and on HSDP the replica all-reduce and its wait), or
    through the sum of such results (a parameter used twice, such as tied embeddings, gets
    one reduced gradient per use, added up). Other consumers may branch off on the way; a
    tensor-parallel reduce-scatter, whose result only feeds further compute, does not
    qualify, nor one marked tensor-parallel (``mark_tensor_parallel``: a forward's
    sequence-parallel reduce-scatter is returned, saved for the backward)."""
    if not is_reduce_scatter(node) or node.meta.get(TENSOR_PARALLEL_KEY):
        return False
    if param_fqn(node) is not None:
        return True
    seen = {node}
    stack = [node]
    while stack:
        for user in data_users(stack.pop()):
            if user.op == "output":
                return True
            if user in seen:
                continue
            inputs = data_inputs(user)
            if len(inputs) == 1 or (_is_add(user) and all(_reduced(i) for i in inputs)):
                seen.add(user)
                stack.append(user)
    return False


def _is_add(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.aten.add.Tensor


def _reduced(node: fx.Node, limit: int = _REDUCED_WALK_LIMIT) -> bool:
    """``node`` is a reduce-scatter's result, through single-input operations and sums of
    such results (the gradient of a parameter with several uses)."""
    stack, seen = [node], set()
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if len(seen) > limit:
            return False
        if is_reduce_scatter(cur):
            continue
        inputs = data_inputs(cur)
        if not inputs or not (len(inputs) == 1 or _is_add(cur)):
            return False
        stack.extend(inputs)
    return True


def graph_kind(graph: fx.Graph) -> str:
    """ "backward" if the graph takes tangents, else "forward" (training or inference)."""
    for node in graph.find_nodes(op="placeholder"):
        if node.name.startswith("tangents"):
            return "backward"
    return "forward"


def collective_counts(graph: fx.Graph, groups: Any = None, *, exclude: bool = False) -> dict[str, int]:
    """How many of each collective (and waits) a graph holds; with ``groups`` (process
    group names), only those on one of them (a wait counts with its collective), or with
    ``exclude`` only those on none of them."""
    counts: Counter[str] = Counter()
    for node in graph.nodes:
        if groups is not None:
            launch = collective_of_wait(node) if is_wait(node) else node if is_collective(node) else None
            if launch is None or (group_name(launch) in groups) == exclude:
                continue
        if is_wait(node):
            counts["wait"] += 1
        elif is_all_gather(node):
            counts["all_gather"] += 1
        elif is_reduce_scatter(node):
            counts["reduce_scatter"] += 1
        elif is_all_reduce(node):
            counts["all_reduce"] += 1
        elif effective_target(node) is C10D.all_to_all_single.default:
            counts["all_to_all"] += 1
        elif is_collective(node):
            counts["other"] += 1
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "wait", "other")
    return {k: counts.get(k, 0) for k in kinds}
