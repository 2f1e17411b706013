"""The shape of benchmarks/: the modules of ``_harness`` import one another without a loop
(imports under ``if TYPE_CHECKING:`` count: a type-only back edge is still a loop to read),
and the scripts build their models only through ``_harness/models.py`` (so a model's shapes
and seed are written once, and the tests that check the benchmarks' numbers see them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
HARNESS = BENCHMARKS / "_harness"
# calls that build a model or a model config (as a name or as an attribute: ``T.LlamaConfig``)
BUILDERS = {
    "LlamaConfig",
    "LlamaForCausalLM",
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "from_config",  # AutoModelForCausalLM.from_config
    "_from_config",
    "for_model",  # AutoConfig.for_model
    "model_from_config",  # fsdp_overlap_plugin.shard.hf
    "GPT",
    "GPTConfig",
    "gpt_small",
    "gpt_bench",
    "gpt_1b",
}
# the one module that may call them
BUILDER_MODULE = HARNESS / "models.py"


def _harness_targets(node: ast.stmt, names: set[str]) -> list[str]:
    """The ``_harness`` modules an import statement imports (``_harness.x``, ``from _harness
    import x``, ``from _harness.x import y``, and the relative spellings)."""
    if isinstance(node, ast.Import):
        return [a.name.split(".")[1] for a in node.names if a.name.startswith("_harness.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    module = node.module or ""
    if module == "_harness" or (node.level and not module):
        found = [a.name for a in node.names]
    elif module.startswith("_harness."):
        found = [module.split(".")[1]]
    elif node.level:
        found = [module.split(".")[0]]
    else:
        found = []
    return [name for name in found if name in names]


def harness_graph() -> dict[str, set[str]]:
    """Module -> the ``_harness`` modules it imports, anywhere in it (a function's body and
    ``if TYPE_CHECKING:`` blocks included)."""
    names = {p.stem for p in HARNESS.glob("*.py")} - {"__init__"}
    graph: dict[str, set[str]] = {}
    for name in sorted(names):
        tree = ast.parse((HARNESS / f"{name}.py").read_text())
        graph[name] = {t for node in ast.walk(tree) for t in _harness_targets(node, names) if t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` as its modules in order (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def model_builds(path: Path) -> list[str]:
    """``line: call`` for each call in ``path`` to one of ``BUILDERS``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in BUILDERS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(func)}(...)")
    return found


def test_harness_imports_have_no_loop():
    graph = harness_graph()
    assert graph["runners"] >= {"memory", "models", "trace"}  # the walk sees the edges that exist
    assert "types" in graph["memory"] and "types" in graph["trace"]  # TYPE_CHECKING imports are seen
    cycle = find_cycle(graph)
    assert cycle is None, "benchmarks/_harness imports in a loop: " + " -> ".join(cycle)


def test_find_cycle_sees_a_type_only_back_edge():
    # the loop this file was written against: runners -> memory -> runners (TYPE_CHECKING)
    graph = {"runners": {"memory", "models"}, "memory": {"runners"}, "models": set()}
    assert find_cycle(graph) == ["memory", "runners", "memory"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_only_harness_models_builds_models():
    files = sorted(BENCHMARKS.glob("*.py")) + sorted(HARNESS.glob("*.py"))
    assert BUILDER_MODULE in files and len(files) > 20
    assert model_builds(BUILDER_MODULE), "the check must see models.py's own builder calls"
    found = [hit for path in files if path != BUILDER_MODULE for hit in model_builds(path)]
    assert not found, (
        "build models and model configs through benchmarks/_harness/models.py (build_gpt, gpt_preset, "
        "llama_config, llama3_8b_config, build_llama), not in the script:\n" + "\n".join(found)
    )
