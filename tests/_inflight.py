"""The in-flight rule, checked on the Python code inductor generates (what really runs).

A collective reads its input and writes its output asynchronously, from its launch to
its wait (on gloo in a ``pt_gloo_runloop`` thread, on NCCL on the communication stream).
So between the two, no buffer it touches may be freed, reused for another tensor, or
written by anything else; and its output may not be read before the wait. A breach is a
heap corruption on gloo (bytes received into memory given to someone else) and silent
data corruption on a GPU. ``inflight_breaches(code)`` lists every breach in one module of
generated code.

It parses the module with ``ast`` (the wrapper is plain Python) and walks the statements of
its ``call`` function in order. Every mention of a buffer (a name the function binds) is a
use, classified from what the code itself declares, and anything it cannot classify counts
as a write (conservative: an unknown call touching a buffer in flight is a breach):

* ``torch.ops.<ns>.<op>.<overload>`` calls (also through the module's ``aten = torch.ops.aten``
  style aliases): the op's schema. An argument marked ``Tensor(a!)`` is written, any other
  read; a return marked ``Tensor(a)`` is an alias of the arguments in the same alias set
  (``aten.slice``, ``aten.as_strided``, ``all_gather_into_tensor_out``'s ``out``, ...);
* C++ kernels: their ``async_compile.cpp_pybinding`` type list (a ``const`` pointer is read,
  any other written);
* ``extern_kernels.<f>`` of a known pure op (``mm``, ``addmm``, ...): ``out=`` written,
  the rest read; any other extern: every argument written;
* methods of a buffer: views (``view``, ``reshape``, ``as_strided``, ...) alias it, metadata
  (``size``, ``stride``, ...) is no use, a name ending in ``_`` writes it, anything else
  writes it; ``bufA[...]``, ``bufB = bufA`` and ``reinterpret_tensor(bufA, ...)`` alias it;
* ``assert_size_stride`` / ``assert_alignment`` / ``assert_tensor_metadata`` read metadata only;
* ``del bufA`` frees it (``...; del bufA  # reuse`` reuses it);
* any other call or expression: every buffer it mentions is written, and its result
  aliases them all.

Aliases join storages (union-find over the module: inductor binds each name once).
Collectives are the ``_c10d_functional`` ops: a launch reads its read arguments and writes
its ``(a!)`` arguments and its result; its window runs to ITS OWN wait, the first
``wait_tensor`` after it on a storage it writes. In the window, a free, reuse or write of
any storage it touches, or a read of a storage it writes, is a breach; so is a launch
never waited. (A coalesced launch whose outputs are waited one by one ends at the first
of those waits; the plugin emits none.)
"""

from __future__ import annotations

import ast

import torch

import fsdp_overlap_plugin.passes.ops  # noqa: F401 (registers torch.ops.fsdp_overlap: their schemas)

# assert_tensor_metadata: assert_size_stride with a dtype, which torch 2.14's inductor writes
# after a custom op (our receive-first exchange among them)
META_FUNCTIONS = {"assert_size_stride", "assert_alignment", "assert_tensor_metadata"}
META_METHODS = {"size", "stride", "dim", "numel", "storage_offset", "element_size", "is_contiguous"}
VIEW_METHODS = {
    "view", "reshape", "as_strided", "narrow", "select", "expand", "expand_as", "permute", "t", "transpose",
    "unsqueeze", "squeeze", "flatten", "unflatten", "view_as", "split", "chunk", "unbind", "detach", "contiguous",
}  # fmt: skip
PURE_EXTERN = {"mm", "bmm", "addmm", "baddbmm", "addmv", "addbmm", "addr", "convolution", "_mm_plus_mm", "_int_mm"}
# functions whose schema says "fresh" but whose result is (a view of) an argument
ALIASING_OPS = {"torch.ops.inductor._alloc_from_pool", "torch.ops._c10d_functional.wait_tensor"}
COLLECTIVES = "torch.ops._c10d_functional."


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _schema(dotted: str):
    obj = torch.ops
    try:
        for part in dotted.split(".")[2:]:
            obj = getattr(obj, part)
        if not hasattr(obj, "_schema"):  # a packet (``torch.ops.inductor._alloc_from_pool``)
            obj = obj.default
        return obj._schema
    except (AttributeError, RuntimeError):
        return None


class _Module:
    """The facts of one generated module: its kernels' signatures, its aliases of
    ``torch.ops`` namespaces, and the storage each buffer name belongs to."""

    def __init__(self, tree: ast.Module, call: ast.FunctionDef):
        self.const: dict[str, list[bool]] = {}
        self.prefix: dict[str, str] = {}  # "aten" -> "torch.ops.aten"
        for node in tree.body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
                continue
            name, value = node.targets[0].id, node.value
            if isinstance(value, ast.Call) and (_dotted(value.func) or "").endswith("cpp_pybinding"):
                types = ast.literal_eval(value.args[0])
                self.const[name] = [t.strip().startswith("const") for t in types]
            elif (dotted := _dotted(value)) and dotted.startswith("torch.ops."):
                self.prefix[name] = dotted
        self.buffers = {a.arg for a in call.args.args if a.arg not in ("self", "args")}
        for node in ast.walk(call):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id != "args":
                self.buffers.add(node.id)
        self.root: dict[str, str] = {}

    def storage(self, name: str) -> str:
        while name in self.root:
            name = self.root[name]
        return name

    def join(self, a: str, b: str) -> None:
        a, b = self.storage(a), self.storage(b)
        if a != b:
            self.root[a] = b

    def resolve(self, func: ast.AST) -> str | None:
        dotted = _dotted(func)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in self.prefix:
            return self.prefix[head] + ("." + rest if rest else "")
        return dotted


class _Statement:
    """The uses of one statement: ``(kind, name, by)`` with kind read, write, touch (an
    unknown use, counted as a write), free or reuse; the aliases its result takes; and the
    collective it launches or waits on, if any."""

    def __init__(self, module: _Module):
        self.m = module
        self.uses: list[tuple[str, str, str]] = []
        self.launch: tuple[str, set[str], set[str]] | None = None  # (op, read names, written names)
        self.wait: str | None = None

    def use(self, kind: str, names: set[str], by: str) -> None:
        self.uses.extend((kind, n, by) for n in sorted(names))

    def expr(self, node: ast.AST | None) -> set[str]:
        """The buffers ``node``'s value may alias; records the uses inside it."""
        if node is None or isinstance(node, ast.Constant):
            return set()
        if isinstance(node, ast.Name):
            return {node.id} if node.id in self.m.buffers else set()
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(self.expr(e) for e in node.elts))
        if isinstance(node, ast.Starred):
            return self.expr(node.value)
        if isinstance(node, ast.Subscript):
            self.use("read", self.expr(node.slice), "index")
            return self.expr(node.value)
        if isinstance(node, ast.Attribute):
            return self.expr(node.value)  # ``buf.T``, ``torch.float32``
        if isinstance(node, ast.Call):
            return self.call(node)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in self.m.buffers}
        self.use("touch", names, f"expression {type(node).__name__}")
        return names

    def call(self, node: ast.Call) -> set[str]:
        func = self.m.resolve(node.func) or ""
        short = func.removeprefix("torch.ops.")
        if func == "reinterpret_tensor":
            for arg in node.args[1:]:
                self.expr(arg)
            return self.expr(node.args[0]) if node.args else set()
        if func in META_FUNCTIONS:  # the buffers it names: their sizes, strides, address
            for arg in [*node.args, *(kw.value for kw in node.keywords)]:
                if not isinstance(arg, ast.Name):
                    self.use("touch", self.expr(arg), func)
            return set()
        if func in self.m.const:
            const = self.m.const[func]
            for i, arg in enumerate(node.args):
                names = self.expr(arg)
                kind = "touch" if i >= len(const) else ("read" if const[i] else "write")
                self.use(kind, names, func)
            for kw in node.keywords:
                self.use("touch", self.expr(kw.value), func)
            return set()
        if func.startswith("torch.ops.") and (schema := _schema(func)) is not None:
            return self.op(node, func, short, schema)
        if func.startswith("extern_kernels."):
            pure = func.split(".", 1)[1] in PURE_EXTERN
            for arg in node.args:
                self.use("read" if pure else "touch", self.expr(arg), func)
            for kw in node.keywords:
                names = self.expr(kw.value)
                self.use(
                    "write" if kw.arg == "out" else ("read" if pure else "touch"),
                    names,
                    "out=" if kw.arg == "out" else func,
                )
            return set()
        if isinstance(node.func, ast.Attribute) and (base := self.expr(node.func.value)):
            method = node.func.attr
            for arg in [*node.args, *(kw.value for kw in node.keywords)]:
                self.use("read" if method in VIEW_METHODS else "touch", self.expr(arg), method)
            if method in META_METHODS:
                return set()
            if method in VIEW_METHODS:
                return base
            self.use("write" if method.endswith("_") else "touch", base, "in place" if method.endswith("_") else method)
            return base
        # an unknown function: every buffer it is given is written, and may come back
        names = set()
        for arg in [*node.args, *(kw.value for kw in node.keywords)]:
            names |= self.expr(arg)
        self.use("touch", names, f"unknown call {func or ast.unparse(node.func)}")
        return names

    def op(self, node: ast.Call, func: str, short: str, schema) -> set[str]:
        params = schema.arguments
        by_name = {a.name: a for a in params}
        bound = [(params[i] if i < len(params) else None, arg) for i, arg in enumerate(node.args)]
        bound += [(by_name.get(kw.arg), kw.value) for kw in node.keywords]
        result, reads, writes = set(), set(), set()
        alias_sets = [r.alias_info.before_set for r in schema.returns if r.alias_info is not None]
        for param, arg in bound:
            names = self.expr(arg)
            info = param.alias_info if param is not None else None
            if param is None:
                self.use("touch", names, short)
                writes |= names
                continue
            aliased = info is not None and any(info.before_set & s for s in alias_sets)
            if aliased:
                result |= names  # a view of it (not a use yet), or the tensor it writes in place
            if info is not None and info.is_write:
                writes |= names
            elif not aliased:
                reads |= names
        if func.rsplit(".", 1)[0] in ALIASING_OPS:
            result |= reads
        if func.startswith(COLLECTIVES):
            op = func[len(COLLECTIVES) :].split(".")[0]
            if op == "wait_tensor":
                self.wait = next(iter(reads), None)
                return result
            self.launch = (op, reads, writes)
        self.use("read", reads, short)
        self.use("write", writes, short)
        return result


def _body(stmts: list[ast.stmt]) -> list[ast.stmt]:
    out = []
    for s in stmts:
        if isinstance(s, (ast.With, ast.If, ast.For, ast.While, ast.Try)):
            out.append(s)  # its own header uses (as an unknown expression), then its body
            for field in ("body", "orelse", "handlers", "finalbody"):
                for sub in getattr(s, field, []):
                    out += _body(sub.body if isinstance(sub, ast.ExceptHandler) else [sub])
        else:
            out.append(s)
    return out


def inflight_breaches(code: str) -> tuple[list[str], int]:
    """``(breaches, windows)``: every breach of the in-flight rule in ``code`` (one line
    each: the collective, the offending line and what it does), and how many launch-to-wait
    windows were checked (one per collective launched)."""
    tree = ast.parse(code)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "call"]
    if len(calls) != 1:
        raise ValueError(f"expected one `def call` in the generated module, found {len(calls)}")
    module = _Module(tree, calls[0])
    lines = code.splitlines()
    statements: list[tuple[int, _Statement]] = []
    for node in _body(calls[0].body):
        st = _Statement(module)
        if isinstance(node, ast.Delete):
            reuse = "# reuse" in lines[node.lineno - 1]
            for target in node.targets:
                st.use("reuse" if reuse else "free", st.expr(target), "del")
        elif isinstance(node, ast.Assign):
            sources = st.expr(node.value)
            for target in node.targets:
                for name in {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}:
                    for source in sources:
                        module.join(name, source)
            if st.launch is not None and not st.launch[2]:  # a fresh result: what the launch writes
                targets = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                st.launch = (st.launch[0], st.launch[1], targets)
        elif isinstance(node, ast.Expr):
            st.expr(node.value)
        elif isinstance(node, ast.Return):
            st.use("read", st.expr(node.value), "return")
        elif isinstance(node, (ast.With, ast.If, ast.For, ast.While, ast.Try)):
            header = [getattr(node, f, None) for f in ("test", "iter", "target")]
            header += [item.context_expr for item in getattr(node, "items", [])]
            for h in header:
                if h is not None:
                    names = {n.id for n in ast.walk(h) if isinstance(n, ast.Name) and n.id in module.buffers}
                    st.use("touch", names, type(node).__name__)
        else:
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in module.buffers}
            st.use("touch", names, type(node).__name__)
        statements.append((node.lineno, st))

    breaches, windows = [], 0
    for k, (start, launch) in enumerate(statements):
        if launch.launch is None:
            continue
        windows += 1
        op, reads, writes = launch.launch
        written = {module.storage(n) for n in writes}
        touched = written | {module.storage(n) for n in reads}
        result = ", ".join(sorted(writes))
        end = next(
            (i for i in range(k + 1, len(statements)) if (w := statements[i][1].wait) and module.storage(w) in written),
            None,
        )
        if end is None:
            breaches.append(f"{op} at line {start} ({result}): never waited")
            continue
        for line, st in statements[k + 1 : end]:
            hit = []
            for kind, name, by in st.uses:
                where = module.storage(name)
                if where not in touched:
                    continue
                if kind in ("free", "reuse"):
                    hit.append(f"{'reuses' if kind == 'reuse' else 'frees'} {name}")
                elif kind == "write":
                    hit.append(f"writes {name} ({by})")
                elif kind == "touch":
                    hit.append(f"touches {name} ({by}: counted as a write)")
                elif where in written:
                    hit.append(f"reads {name} before the wait ({by})")
            if hit:
                breaches.append(f"{op} at line {start} ({result}), line {line}: {'; '.join(sorted(set(hit)))}")
    return breaches, windows
