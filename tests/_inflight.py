"""The in-flight rule, checked on the Python code inductor generates (what really runs).

A collective reads its input and writes its output asynchronously, from its launch to
its wait (on gloo in a ``pt_gloo_runloop`` thread, on NCCL on the communication stream).
So between the two, no buffer it touches may be freed, reused for another tensor, or
written by anything else; and its output may not be read before the wait. A breach is a
heap corruption on gloo (bytes received into memory given to someone else) and silent
data corruption on a GPU. ``inflight_breaches(code)`` lists every breach in one module of
generated code, reading:

* launches: ``bufN = torch.ops._c10d_functional.<op>.default(args)`` and the in-place
  ``torch.ops._c10d_functional.<op>_out.default(args, out=bufM)``; the buffers of a
  launch are the names in its arguments and its result;
* waits: ``torch.ops._c10d_functional.wait_tensor.default(bufN)`` (the first one);
* aliases: ``bufB = reinterpret_tensor(bufA, ...)`` and ``bufB = bufA`` make ``bufB`` the
  storage of ``bufA``;
* writes: a C++ kernel's non-``const`` pointer arguments (its ``cpp_pybinding`` type
  list), ``out=`` arguments, in-place methods (``bufA.copy_(...)``);
* frees and reuses: ``del bufA`` and ``...; del bufA  # reuse``.
"""

from __future__ import annotations

import re

_BINDING = re.compile(r"^(\w+) = async_compile\.cpp_pybinding\(\[(.*?)\]")
_ASSIGN = re.compile(r"^\s*(\w+) = (.*)$")
_C10D = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\((.*)\)\s*$")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)")
_ALIAS = re.compile(r"^(?:reinterpret_tensor\()?(\w+)\b")
_DEL = re.compile(r"\bdel (\w+)")
_OUT = re.compile(r"\bout=(?:reinterpret_tensor\()?(\w+)")
_INPLACE = re.compile(r"\b(\w+)\.\w+_\(")
_CALL = re.compile(r"^\s*(?:\w+ = )?(\w+)\((.*)\)\s*$")
_NAME = re.compile(r"\b([A-Za-z_]\w*)\b")


def _top_level_args(text: str) -> list[str]:
    args, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        args.append(text[start:])
    return [a.strip() for a in args]


def inflight_breaches(code: str) -> tuple[list[str], int]:
    """``(breaches, windows)``: every breach of the in-flight rule in ``code`` (one line
    each: the collective, the offending line and what it does), and how many launch-to-wait
    windows were checked."""
    lines = code.splitlines()
    const: dict[str, list[bool]] = {}
    for line in lines:
        if m := _BINDING.match(line):
            const[m.group(1)] = [t.strip().strip("'\"").startswith("const") for t in m.group(2).split(",")]
    root: dict[str, str] = {}  # buffer -> the buffer whose storage it is

    def storage(name: str) -> str:
        while name in root:
            name = root[name]
        return name

    launches: list[tuple[int, str, set[str], str]] = []  # (line, result, storages, what)
    events: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        body = line.split("#", 1)[0]
        if m := _ASSIGN.match(body):
            target, value = m.group(1), m.group(2).split(";")[0].strip()
            if (a := _ALIAS.match(value)) and (value.startswith("reinterpret_tensor(") or value == a.group(1)):
                root[target] = a.group(1)
        if (m := _C10D.search(body)) and m.group(1) != "wait_tensor":
            names = {n for n in _NAME.findall(m.group(2)) if n.startswith(("buf", "primals", "tangents", "arg"))}
            out = _OUT.search(m.group(2))
            result = out.group(1) if out else (_ASSIGN.match(body).group(1) if _ASSIGN.match(body) else "")
            launches.append((i, result, {storage(n) for n in names | {result}}, m.group(1)))
        events.append((i, body))
    waits: dict[str, int] = {}
    for i, body in events:
        if m := _WAIT.search(body):
            waits.setdefault(storage(m.group(1)), i)

    breaches = []
    for start, result, touched, op in launches:
        end = waits.get(storage(result))
        if end is None:
            breaches.append(f"{op} at line {start + 1} ({result}): never waited")
            continue
        result_storage = storage(result)
        for i in range(start + 1, end):
            line = lines[i]
            body = line.split("#", 1)[0]
            hit = []
            for name in _DEL.findall(body):
                if storage(name) in touched:
                    hit.append(f"reuses {name}" if "# reuse" in line else f"frees {name}")
            for name in _OUT.findall(body):
                if storage(name) in touched:
                    hit.append(f"writes {name} (out=)")
            for name in _INPLACE.findall(body):
                if storage(name) in touched and name != "torch":
                    hit.append(f"writes {name} (in place)")
            if (m := _CALL.match(body)) and m.group(1) in const:
                for arg, is_const in zip(_top_level_args(m.group(2)), const[m.group(1)]):
                    for name in _NAME.findall(arg):
                        if storage(name) in touched and not is_const:
                            hit.append(f"writes {name} ({m.group(1)})")
                        elif storage(name) == result_storage and is_const:
                            hit.append(f"reads {name} before the wait ({m.group(1)})")
            elif m := _C10D.search(body):
                if m.group(1) != "wait_tensor" and any(storage(n) == result_storage for n in _NAME.findall(m.group(2))):
                    hit.append(f"hands {result} to {m.group(1)} before the wait")
            if hit:
                breaches.append(f"{op} at line {start + 1} ({result}), line {i + 1}: {'; '.join(sorted(set(hit)))}")
    return breaches, len(launches)
