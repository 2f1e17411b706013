"""README.md stays true: every command and code block in it is run here or by a named test,
every relative link in it and in the user docs it points to resolves, and it stays short.

* **Commands.** Every line of a ```bash block, and every inline code span that is a
  command (``python ...``, ``make ...``, ``torchrun ...``; ``fsdp-overlap``, ``accelerate``,
  ``pip`` or a ``*.py`` script with at least two arguments; without ``...``) is either typed
  as written, in a new shell, by tests/repo/test_readme_shell.py (slow, on the newest torch of the
  matrix; its parameters are ``run_as_written(README_COMMANDS)``, checked here), or listed in
  ``NOT_RUN`` with why. A new README command is run by that test, or listed, or CI fails.
  Here, quickly and on every torch, each one is also checked in this process in a directory
  holding the repository's ``configs/`` and ``examples/`` and small real files at the
  README's placeholder paths (``path/to/config.json`` is a 2-layer Llama config,
  ``checkpoints/step_00000100`` a real ``checkpoint.save`` folder, ``my_pkg.model:build`` a
  small GPT, ``report.json`` the report fixture): ``fsdp-overlap inspect / check / explain /
  export`` run to the end; ``fsdp-overlap launch`` runs its check and stops where it would
  start ``accelerate launch`` (what it would start is parsed by Accelerate's parser);
  ``torchrun`` and ``accelerate launch`` lines are parsed by their own parsers, their config
  files read by the runtime's reader, and their scripts' arguments by the script's own
  ``argparse``; ``python examples/lightning_gpt.py ...`` runs the script's ``main`` up to
  ``Trainer.fit``; ``make`` targets are read from the Makefile (``demo``'s recipe is checked
  as a torchrun line, and run by test_the_demo_trains_on_2_ranks_and_its_report_explains).
* **Code blocks.** Every ```python block must match one entry of ``PYTHON_BLOCKS``, which
  runs it on CPU in this process (a fake process group of 2 ranks where it needs one,
  ``backend: aot_eager`` for speed) or, where it needs a launcher, imports what it imports
  and names the test that runs it. ```yaml blocks are checked by ``fsdp-overlap check``,
  ```text blocks (output samples) are not run, and any other block fails.

Adding a block to the README without saying here what runs it fails CI.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_BYTES = 12 * 1024
# The user docs the README sends people to (written with it); their links are checked too.
USER_DOCS = [
    "docs/lightning.md",
    "docs/accelerate.md",
    "docs/transformers.md",
    "docs/export.md",
    "docs/torchrun.md",
    "docs/performance.md",
    "docs/torch-versions.md",
    "docs/tuning.md",
]
PROGRAMS = ("make", "python", "torchrun", "accelerate", "fsdp-overlap", "source", "pip")
FIXTURE_REPORT = ROOT / "tests" / "fixtures" / "cli" / "report.json"


# ----------------------------------------------------------------------------- reading markdown
def strip_fences(text: str) -> tuple[str, list[tuple[str, str]]]:
    """``(text outside fenced blocks, [(language, body)])``."""
    outside, blocks, lines = [], [], iter(text.splitlines())
    for line in lines:
        if line.lstrip().startswith("```"):
            lang, body = line.strip()[3:].strip(), []
            for inner in lines:
                if inner.strip() == "```":
                    break
                body.append(inner)
            else:
                raise AssertionError(f"unclosed ``` block: {line!r}")
            blocks.append((lang, "\n".join(body)))
            outside.append("")
        else:
            outside.append(line)
    return "\n".join(outside), blocks


def bash_lines(body: str) -> list[str]:
    """The commands of a bash block: continuations joined, comments and blank lines dropped."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            out.append(" ".join(argv))
    return out


def inline_commands(prose: str) -> list[str]:
    prose = re.sub(r"<!--.*?-->", "", prose, flags=re.S)
    found = []
    for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", prose):
        try:
            argv = shlex.split(span)
        except ValueError:
            continue
        if not argv or not (argv[0] in PROGRAMS or argv[0].endswith(".py")) or "..." in span:
            continue
        if argv[0] in ("make", "python", "torchrun") or len(argv) >= 3:
            found.append(" ".join(argv))
    return found


def readme_parts(text: str | None = None) -> tuple[list[str], list[tuple[str, str]]]:
    """``(commands, [(language, body)] of the non-bash blocks)`` of README.md (or ``text``),
    in README order, commands once."""
    prose, blocks = strip_fences(README.read_text() if text is None else text)
    commands: list[str] = []
    for lang, body in blocks:
        if lang in ("bash", "sh", "shell"):
            commands += bash_lines(body)
    commands += inline_commands(prose)
    return list(dict.fromkeys(commands)), [(lang, body) for lang, body in blocks if lang not in ("bash", "sh", "shell")]


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: markup removed, lowercased, punctuation other than
    ``-`` and ``_`` dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = strip_fences(path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", prose, flags=re.M):
        base = github_anchor(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    prose, _ = strip_fences(path.read_text())
    prose = re.sub(r"<!--.*?-->", "", prose, flags=re.S)
    prose = re.sub(r"(?<!`)`[^`\n]+`(?!`)", "", prose)  # code spans are not links
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)


# ----------------------------------------------------------------------------- size and links
def test_readme_is_short():
    size = len(README.read_bytes())
    assert size < MAX_README_BYTES, f"README.md is {size} bytes; keep it under {MAX_README_BYTES}: move detail to docs/"


@pytest.mark.parametrize("doc", ["README.md", *USER_DOCS])
def test_relative_links_resolve(doc):
    source = ROOT / doc
    broken = []
    for target in links(source):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve() if path else source
        relative = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(resolved)
        if not resolved.exists():
            broken.append(f"{target}: no file {relative}")
            continue
        if anchor and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {relative}")
    assert broken == [], f"{doc}: " + "; ".join(broken)


def test_readme_points_at_the_user_docs_and_the_reference():
    text = README.read_text()
    for page in [*USER_DOCS, "docs/architecture.md", "docs/config.md", "docs/troubleshooting.md", "docs/report.md"]:
        assert f"]({page}" in text, f"README.md does not link {page}"


def test_github_anchor_rules():
    assert github_anchor("`--config` or `--config_file`") == "--config-or---config_file"
    assert github_anchor("The forward/backward boundary: keeping (2026-12-02, later)") == (
        "the-forwardbackward-boundary-keeping-2026-12-02-later"
    )
    assert github_anchor("7. Activation checkpointing") == "7-activation-checkpointing"


# ----------------------------------------------------------------------------- the sandbox
@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """Real files at the README's placeholder paths (built once)."""
    import _hf

    from fsdp_overlap_plugin.shard import checkpoint

    root = tmp_path_factory.mktemp("readme_assets")
    _hf.config("llama").save_pretrained(root / "path" / "to")  # path/to/config.json
    model = _hf.build("llama", seed=3)
    checkpoint.save(root / "checkpoints", model, torch.optim.SGD(model.parameters(), lr=0.1), step=100)
    assert (root / "checkpoints" / "step_00000100").is_dir()
    shutil.copy(FIXTURE_REPORT, root / "report.json")
    (root / "my_pkg").mkdir()
    (root / "my_pkg" / "__init__.py").write_text("")
    (root / "my_pkg" / "model.py").write_text(
        "from fsdp_overlap_plugin.models import gpt_small\n\n\ndef build():\n    return gpt_small()\n"
    )
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, root / "weights.pt")
    return root


@pytest.fixture
def sandbox(tmp_path, assets, monkeypatch) -> Path:
    """The working directory a README command runs in: the repository's configs/ and
    examples/, the placeholder files, nothing else; no launcher variables inherited."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    for name in ("path", "checkpoints", "report.json", "my_pkg"):
        (tmp_path / name).symlink_to(assets / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "FSDP_")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return tmp_path


# ----------------------------------------------------------------------------- the commands
# Every README command is typed as written, in a new shell, by
# tests/repo/test_readme_shell.py::test_the_readme_command_runs_in_a_new_shell: its parameters are
# ``run_as_written(README_COMMANDS)``, and test_the_shell_test_runs_every_command_not_listed
# fails if they stop being. The set-up line is typed before each of them. The commands it
# does not run are in NOT_RUN, each with why; nowhere else.
SET_UP = "source .venv/bin/activate"
NOT_RUN: dict[str, str] = {
    "make demo": (
        "its prerequisite $(STAMP) runs pip install -e into .venv: typed in a test it would reinstall the venv the "
        "suite runs in (unless a fresh stamp were faked). Its recipe's torchrun line is run by test_the_demo_trains_"
        "on_2_ranks_and_its_report_explains, with --backend aot_eager --report-json added: one 2-rank run, not two"
    ),
    "make test": "runs this whole suite, the shell test included",
    "make test-quick": "runs the quick suite, this file included",
    "pip install -e path/to/fsdp-overlap": (
        "a placeholder path the user fills in; it installs into the user's environment (the Makefile's install "
        "recipe is the same pip install -e)"
    ),
    "examples/gpt_demo.py --report-json report.json": (
        "the demo's arguments in prose, not a command line; test_the_demo_trains_on_2_ranks_and_its_report_"
        "explains runs the demo with --report-json and explains the report"
    ),
}


def run_as_written(commands: list[str]) -> list[str]:
    """The README commands tests/repo/test_readme_shell.py types in a new shell: all but the
    set-up line (typed before each) and NOT_RUN."""
    return [c for c in commands if c != SET_UP and c not in NOT_RUN]


README_COMMANDS, README_BLOCKS = readme_parts()


def test_every_readme_command_is_run_as_written_or_listed_as_not_run():
    assert SET_UP in README_COMMANDS, f"the README no longer says {SET_UP!r}"
    assert run_as_written(README_COMMANDS), "nothing to run"
    stale = [c for c in NOT_RUN if c not in README_COMMANDS]
    assert stale == [], f"NOT_RUN entries no longer in README.md: {stale}"


def test_a_new_readme_command_is_typed_in_a_new_shell_unless_listed():
    """What a README edit adds, in a bash block or in prose, lands in the shell test's list."""
    added = "\n```bash\nfsdp-overlap explain other.json --json\n```\n\nOr `python examples/new.py --fast`.\n"
    commands, _ = readme_parts(README.read_text() + added)
    assert sorted(set(run_as_written(commands)) - set(run_as_written(README_COMMANDS))) == [
        "fsdp-overlap explain other.json --json",
        "python examples/new.py --fast",
    ]


def test_the_shell_test_runs_every_command_not_listed(tmp_path, monkeypatch):
    """The slow shell test's parameters are ``run_as_written``'s, it carries no skip or xfail
    mark, and it types the set-up line before each command."""
    import test_readme_shell as shell

    runs = shell.test_the_readme_command_runs_in_a_new_shell
    marks = {mark.name: mark for mark in runs.pytestmark}
    assert set(marks) == {"slow", "newest_torch", "parametrize"}, sorted(marks)
    assert marks["parametrize"].args == ("command", run_as_written(README_COMMANDS))
    typed = []
    monkeypatch.setattr(shell.subprocess, "run", lambda argv, **kw: typed.append(argv))
    shell.new_shell("fsdp-overlap --version", tmp_path)
    assert typed == [["/bin/bash", "--noprofile", "--norc", "-c", f"{SET_UP} && fsdp-overlap --version"]]


# --- how each program's line is checked
def script_parser(script: Path) -> argparse.ArgumentParser:
    """The script's own ``argparse`` parser, rebuilt from its source (the script itself starts
    ranks or trains when run): ``parser = argparse.ArgumentParser(...)`` and every
    ``parser.add_argument(...)``, wherever they are, with the module's literal constants."""
    text = script.read_text()
    tree = ast.parse(text)
    namespace: dict = {"argparse": argparse, "__doc__": ast.get_docstring(tree)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError, SyntaxError):
                namespace[node.targets[0].id] = ast.literal_eval(node.value)
    statements = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["parser"]:
            statements.append(node)
        elif isinstance(node, ast.Expr) and ast.unparse(node.value).startswith("parser.add_argument("):
            statements.append(node)
    statements.sort(key=lambda n: n.lineno)
    assert statements and ast.unparse(statements[0]).startswith("parser = argparse.ArgumentParser("), script
    exec(compile(ast.Module(body=statements, type_ignores=[]), str(script), "exec"), namespace)
    return namespace["parser"]


def parse_script(script: str, args: list[str]) -> None:
    path = Path(script)
    assert path.is_file(), f"no script {script}"
    if path.as_posix() == "examples/lightning_gpt.py":
        return  # LightningCLI, run by check_lightning_gpt
    parser = script_parser(path)
    try:
        parser.parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{script} refuses {args}") from exc


def check_torchrun(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[1:])
    assert args.nproc_per_node and args.standalone, argv
    parse_script(args.training_script, args.training_script_args)


def launched_script(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The training script and its arguments of a parsed ``accelerate launch``; through the
    plugin's runner (``-m fsdp_overlap_plugin.accelerate SCRIPT ARGS``), the script it runs."""
    from fsdp_overlap_plugin.cli.launch import RUNNER

    if args.module and args.training_script == RUNNER:
        script, *rest = args.training_script_args
        assert script != "-m", "the README runs scripts, not modules"
        return script, rest
    return args.training_script, args.training_script_args


def check_accelerate(argv: list[str], capsys) -> None:
    from accelerate.commands.launch import launch_command_parser

    from fsdp_overlap_plugin.cli import main

    assert argv[1] == "launch", argv
    args = launch_command_parser().parse_args(argv[2:])
    assert args.config_file and Path(args.config_file).is_file(), argv
    # the config as the workers' prepare() will read it (fsdp-overlap check uses that reader)
    assert main(["check", args.config_file, "--json"]) == 0, capsys.readouterr()
    assert json.loads(capsys.readouterr().out)["config"]["shape"] == "accelerate"
    parse_script(*launched_script(args))


def check_make(argv: list[str]) -> None:
    target = argv[1]
    makefile = (ROOT / "Makefile").read_text()
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert found, f"no Makefile target {target}"
    recipe = [line.strip() for line in found.group(1).splitlines()]
    if target == "demo":
        (line,) = recipe
        assert line.startswith("$(BIN)/torchrun "), line
        check_torchrun(shlex.split(line.replace("$(BIN)/", "")))
    else:
        assert any("-m pytest" in line for line in recipe), recipe


def check_pip(argv: list[str]) -> None:
    """``pip install -e path/to/fsdp-overlap``: an editable install of the clone's folder, a
    project pip can build (a build backend, the package, and the ``hf`` extra the README
    adds as ``'path/to/fsdp-overlap[hf]'``)."""
    assert argv[:3] == ["pip", "install", "-e"] and argv[3] == "path/to/fsdp-overlap", argv
    pyproject = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+, the project 3.10+
    for line in ('build-backend = "', 'name = "fsdp-overlap-plugin"', "\nhf = ["):
        assert line in pyproject, f"pyproject.toml has no {line.strip()!r}"


def check_activate(argv: list[str]) -> None:
    """``source .venv/bin/activate``: the Makefile's venv, and a venv's activation script."""
    assert re.search(r"^VENV +:= +\.venv$", (ROOT / "Makefile").read_text(), flags=re.M), "the Makefile's venv moved"
    assert argv == ["source", ".venv/bin/activate"], argv
    assert sys.prefix != sys.base_prefix and (Path(sys.prefix) / "bin" / "activate").is_file(), sys.prefix


def check_lightning_gpt(args: list[str], monkeypatch) -> None:
    """``python examples/lightning_gpt.py ARGS``: the script's ``main`` with ``Trainer.fit``
    recorded instead of run (it would start a second rank)."""
    from lightning.pytorch import Trainer

    from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy

    fits = []
    monkeypatch.setattr(Trainer, "fit", lambda self, *a, **k: fits.append(self))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.setattr(sys, "argv", ["examples/lightning_gpt.py", *args])
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    import lightning_gpt

    threads = torch.get_num_threads()
    try:
        lightning_gpt.main()
    finally:
        torch.set_num_threads(threads)
    (trainer,) = fits
    assert isinstance(trainer.strategy, FSDPOverlapStrategy)


def check_fsdp_overlap(argv: list[str], capsys, monkeypatch, sandbox: Path) -> None:
    from accelerate.commands.launch import launch_command_parser

    from fsdp_overlap_plugin.cli import launch, main

    if argv[1] == "launch":
        started = []
        monkeypatch.setattr(launch, "_run", lambda cmd, env: started.append(cmd) or 0)
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, out + err
        (cmd,) = started
        assert cmd[1:3] == ["-m", "accelerate.commands.launch"], cmd
        args = launch_command_parser().parse_args(cmd[3:])  # what it starts, as Accelerate reads it
        assert args.module and args.training_script == "fsdp_overlap_plugin.accelerate", cmd  # its runner
        parse_script(*launched_script(args))
        return
    code = main([*argv[1:], "--json"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    result = json.loads(out.splitlines()[-1])
    if argv[1] == "export":
        check_export(Path(argv[3]), result)


def check_export(folder: Path, result: dict) -> None:
    """The exported folder loads with plain from_pretrained and holds the checkpoint's weights."""
    import transformers

    assert folder.is_dir(), result
    import _hf

    assert _hf.head_storage_problems(folder, "llama") == []  # the files: no lm_head.weight (tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    saved = torch.load(Path("checkpoints").resolve().parent / "weights.pt")
    state = model.state_dict()
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("command", README_COMMANDS)
def test_readme_command_works(command, sandbox, capsys, monkeypatch):
    """Quick, on every torch of the matrix, in this process: each command's arguments as its
    program parses them, the files it reads, and what the fsdp-overlap commands print. Not
    proof that it runs in a shell as typed (test_readme_shell.py is), nor of a NOT_RUN one."""
    argv = shlex.split(command)
    program = argv[0]
    if program.endswith(".py"):  # a script's arguments, in prose
        parse_script(program, argv[1:])
    elif program == "pip":
        check_pip(argv)
    elif program == "make":
        check_make(argv)
    elif program == "source":
        check_activate(argv)
    elif program == "torchrun":
        check_torchrun(argv)
    elif program == "accelerate":
        check_accelerate(argv, capsys)
    elif program == "fsdp-overlap":
        check_fsdp_overlap(argv, capsys, monkeypatch, sandbox)
    elif program == "python" and argv[1] == "examples/lightning_gpt.py":
        check_lightning_gpt(argv[2:], monkeypatch)
    elif program == "python" and argv[1] == "benchmarks/gpu_check.py":
        from _cuda import gpu_check

        gpu_check().parse_args(argv[2:])
    elif program == "python":
        parse_script(argv[1], argv[2:])
    else:
        raise AssertionError(f"{command}: no way to check a {program} command here")


@pytest.mark.slow
def test_the_demo_trains_on_2_ranks_and_its_report_explains(tmp_path, capsys):
    """``make demo``'s recipe for real (aot_eager here, to keep CI short; inductor is the
    default and is trained by the other end-to-end tests), then ``fsdp-overlap explain``
    on the report it writes."""
    from fsdp_overlap_plugin.cli import main

    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n\t(.*)\n", makefile, flags=re.M).group(1)
    argv = shlex.split(recipe.replace("$(BIN)/torchrun", f"{sys.executable} -m torch.distributed.run"))
    assert argv[-1] == "examples/gpt_demo.py" and "--nproc-per-node" in argv
    report = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [*argv, "--backend", "aot_eager", "--report-json", str(report)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", proc.stdout, flags=re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0], proc.stdout
    # the summary opens in plain words; its details follow
    assert "\nfsdp-overlap summary: 2 ranks, compiled with aot_eager, both passes on\n" in proc.stdout
    assert "  buckets: 6 (tok_emb + pos_emb; blocks.0 to blocks.3, one each; norm + head)" in proc.stdout
    assert "details (every term is explained in docs/report.md):" in proc.stdout
    # the README's sample of the summary is what the demo prints (numbers aside; the
    # sample is inductor's, this run aot_eager's)
    sample = re.search(r"```text\n(.*?)```", README.read_text(), flags=re.S).group(1).splitlines()
    summary = sample[sample.index("fsdp-overlap summary: 2 ranks, compiled with inductor, both passes on") :]
    summary = summary[: summary.index("details (every term is explained in docs/report.md):") + 1]
    printed = proc.stdout.splitlines()
    for line in summary:
        pattern = re.escape(line.replace("inductor", "aot_eager"))
        pattern = re.sub(r"\d+(?:\\\.\d+)?", r"[\\d.]+", pattern)  # 3\.6 -> [\d.]+
        assert any(re.fullmatch(pattern, p) for p in printed), (line, pattern)
    assert main(["explain", str(report)]) == 0
    explained = capsys.readouterr().out
    # every backward bucket's reduce-scatter is shown as what ran, never as nothing
    assert explained.count("(reduce-scatter, sent as all-to-all)") == 6, explained
    assert "none" not in explained.split("backward", 1)[1], explained


# ----------------------------------------------------------------------------- the code blocks
def _aot_eager(monkeypatch) -> None:
    """Every ``parallelize`` call compiles with aot_eager (seconds, not minutes, on 2 cores)."""
    import fsdp_overlap_plugin as fo

    real = fo.parallelize

    def fast(model, config=None, **overrides):
        return real(model, config, **{"backend": "aot_eager", **overrides})

    monkeypatch.setattr(fo, "parallelize", fast)


def _run(code: str, namespace: dict) -> dict:
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def run_core_loop(code: str, monkeypatch, capsys) -> None:
    from _fake import fake_world

    from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

    _aot_eager(monkeypatch)
    with fake_world(2):
        ns = _run(
            code,
            {
                "MyTransformer": lambda: gpt_small(n_layer=2, d_model=32, block_size=16),
                "batches": fixed_batches(2, 4, 16, 256),
                "loss_fn": loss_fn,
            },
        )
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in ns["model"].parameters())
    assert capsys.readouterr().out.strip()  # the report was printed


def run_transformers(code: str, monkeypatch, capsys) -> None:
    import _hf
    import transformers
    from _fake import fake_world

    import fsdp_overlap_plugin as fo

    _aot_eager(monkeypatch)
    with fake_world(2):
        ns = _run(
            code, {"transformers": transformers, "fo": fo, "config": _hf.config("llama"), "ids": _hf.batches(1, 2)[0]}
        )
        assert math.isfinite(ns["loss"].item())
        ns["loss"].backward()
        plan = fo.schedule_report(ns["model"])["plan"]
    assert len(plan) == 2 + 2  # embedding, 2 decoder layers, norm + head
    assert ["model.layers.0"] in plan


def run_lightning(code: str, monkeypatch, capsys) -> None:
    from lightning.pytorch import Trainer

    from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy, config_for_precision

    fits = []
    monkeypatch.setattr(Trainer, "fit", lambda self, model, *a, **k: fits.append((self, model)))
    model = object()
    ns = _run(code, {"model": model})
    ((trainer, fitted),) = fits
    assert fitted is model and isinstance(trainer.strategy, FSDPOverlapStrategy)
    # what the strategy gathers and reduces in once it sets up, under the Trainer's precision
    config = config_for_precision(trainer.strategy.overlap_config, trainer.precision)
    assert (config.param_dtype, config.reduce_dtype) == ("bf16", "fp32")
    assert ns["trainer"] is trainer


def run_export(code: str, monkeypatch, capsys) -> None:
    import _hf
    import transformers

    import fsdp_overlap_plugin as fo

    model = _hf.build("llama", seed=5)
    _run(code, {"fo": fo, "model": model})
    assert _hf.head_storage_problems("trained", "llama") == []  # the files: no lm_head.weight (tied)
    loaded = transformers.AutoModelForCausalLM.from_pretrained("trained/")
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def _function_source(spec: str) -> str:
    file, _, name = spec.partition("::")
    text = (ROOT / file).read_text()
    if not name:
        return text
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return ast.get_source_segment(text, node) or ""
    raise AssertionError(f"{spec}: no function {name} in {file}")


def imports_only(real: str) -> Callable:
    """A block that needs a launcher: what it imports must exist; ``real`` runs it."""

    def check(code: str, monkeypatch, capsys) -> None:
        tree = ast.parse(code)
        imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        assert imports, "nothing to check"
        exec(compile(ast.Module(body=imports, type_ignores=[]), "README.md", "exec"), {})
        assert _function_source(real)

    return check


def run_yaml(code: str, monkeypatch, capsys) -> None:
    """The tuning YAML as both of its comment's readers take it."""
    from fsdp_overlap_plugin.cli import main
    from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy

    Path("tuned.yaml").write_text(code)
    assert main(["check", "tuned.yaml", "--model", "fsdp_overlap_plugin.models.gpt:gpt_small", "--json"]) == 0, (
        capsys.readouterr()
    )
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["shape"] == "plugin"
    strategy = FSDPOverlapStrategy(config="tuned.yaml")
    assert strategy.overlap_config.to_dict() == {**strategy.overlap_config.to_dict(), **yaml.safe_load(code)}


# (language, a line the block holds) -> how it runs
PYTHON_BLOCKS: dict[tuple[str, str], Callable] = {
    ("python", 'trainer = Trainer(strategy="fsdp_overlap"'): run_lightning,
    ("python", "from fsdp_overlap_plugin.accelerate import prepare"): imports_only(
        "tests/accelerate/integration/test_accelerate_launch.py::test_the_real_launch_command_and_fsdp_overlap_launch"
    ),
    ("python", "fo.init_process_group()"): run_core_loop,
    ("python", "AutoModelForCausalLM.from_config(config)"): run_transformers,
    ("python", 'fo.save_pretrained(model, "trained/")'): run_export,
    ("yaml", "bucket_plans: auto"): run_yaml,
}


def _block_id(block: tuple[str, str]) -> str:
    lang, body = block
    return f"{lang}:{body.strip().splitlines()[0][:40]}" if body.strip() else lang


@pytest.mark.parametrize("block", README_BLOCKS, ids=_block_id)
def test_readme_code_block_works(block, sandbox, monkeypatch, capsys):
    lang, body = block
    if lang == "text":
        return  # an output sample
    assert lang in ("python", "yaml"), f"a ```{lang} block: label it bash, python, yaml or text (output)"
    if lang == "python":
        ast.parse(body)
    runners = [run for (kind, marker), run in PYTHON_BLOCKS.items() if kind == lang and marker in body]
    assert len(runners) == 1, f"say in PYTHON_BLOCKS how this block is run ({len(runners)} entries match):\n{body}"
    runners[0](body, monkeypatch, capsys)


def test_inline_strategy_expressions_build(monkeypatch):
    """The README's inline ``FSDPOverlapStrategy(...)`` examples construct, from the repository root."""
    from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy

    monkeypatch.chdir(ROOT)
    prose, _ = strip_fences(README.read_text())
    spans = re.findall(r"`(FSDPOverlapStrategy\([^`]*\))`", prose)
    assert spans, "the README shows the strategy with settings"
    for span in spans:
        assert isinstance(eval(span, {"FSDPOverlapStrategy": FSDPOverlapStrategy}), FSDPOverlapStrategy), span


def test_every_block_entry_is_used():
    bodies = [body for lang, body in README_BLOCKS]
    unused = [key for key in PYTHON_BLOCKS if not any(key[1] in b for b in bodies)]
    assert unused == [], f"PYTHON_BLOCKS entries no README block matches: {unused}"
