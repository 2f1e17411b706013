"""README.md's commands as a new user types them: in a new shell (nothing inherited but HOME
and the system's PATH), after the README's own set-up line, verbatim.

tests/repo/test_readme.py says which README commands these are (``run_as_written``: every command
of the README's bash blocks and prose but the set-up line and its ``NOT_RUN`` table, each
entry with why) and checks, quickly, that this file's parameters are that list; it also
checks each command inside its own process (its arguments, the files it reads), which
cannot see what a new shell does with it. Without the set-up line a new shell answers the
README's commands with "No module named 'torch'" and "command not found"; with it, each
must run as written.

* quick: the README's ``source`` line makes ``python``, ``fsdp-overlap``, ``accelerate`` and
  ``torchrun`` the venv's, and the plugin and the frameworks import there;
* slow (in CI on the newest torch of the matrix): every command of ``run_as_written`` runs
  to the end in a new shell, in a folder holding the repository's configs/, examples/,
  benchmarks/ and the README's placeholder files (tests/repo/test_readme.py's ``assets``). A
  training must end with exit code 0 and print the schedule summary once; ``gpu_check.py``
  must stop with exit code 2 and its message on a machine with no CUDA GPU.

``.venv`` in that folder is the venv running the tests (the README's ``.venv`` under
``make test``, a matrix venv under ``.ci/test-torch``): the line activates it as written.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import _hf
import pytest
import torch
from _dist import NATIVE_CRASHES, count_crash, raise_on_launcher_crash
from test_readme import README_COMMANDS, ROOT, SET_UP, assets, run_as_written  # noqa: F401  (assets: a fixture)

SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# what a test run passes on to the shell besides HOME: one thread per rank on CI's 2 cores,
# faulthandler dumps for the crash policy, no hub access; the runner's caches and crash log
PASSED_ON = ("TORCHINDUCTOR_CACHE_DIR", "FSDP_OVERLAP_CRASH_LOG", "TMPDIR")
RUN_HERE = run_as_written(README_COMMANDS)


def test_the_readme_says_how_a_new_shell_finds_the_commands():
    assert README_COMMANDS.index(SET_UP) < min(README_COMMANDS.index(c) for c in RUN_HERE), (
        "activate before the first command"
    )


def shell_env() -> dict[str, str]:
    env = {
        "HOME": os.environ.get("HOME", "/tmp"),
        "PATH": SYSTEM_PATH,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.update({name: os.environ[name] for name in PASSED_ON if name in os.environ})
    return env


def venv_folder(folder: Path) -> None:
    """``folder/.venv``: the venv this test runs in."""
    assert sys.prefix != sys.base_prefix, "run the tests in a venv (make test)"
    (folder / ".venv").symlink_to(sys.prefix)


def new_shell(command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``command`` typed into a new bash after the README's set-up line."""
    script = f"{SET_UP} && {command}"
    return subprocess.run(
        ["/bin/bash", "--noprofile", "--norc", "-c", script],
        cwd=cwd,
        env=shell_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_set_up_line_makes_the_readme_programs_the_venvs(tmp_path):
    venv_folder(tmp_path)
    probe = (
        "for p in python fsdp-overlap accelerate torchrun; do command -v $p; done; "
        "python -c 'import torch, lightning, accelerate, fsdp_overlap_plugin; print(fsdp_overlap_plugin.__file__)'; "
        "fsdp-overlap --version"
    )
    done = new_shell(probe, tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    *found, package, version = done.stdout.splitlines()
    bin_dir = (tmp_path / ".venv" / "bin").resolve()  # activate names the venv by its real path
    programs = [(Path(f).parent.resolve(), Path(f).name) for f in found]
    assert programs == [(bin_dir, p) for p in ("python", "fsdp-overlap", "accelerate", "torchrun")], found
    assert Path(package).resolve().parent == ROOT / "fsdp_overlap_plugin", package
    assert version.startswith("fsdp-overlap "), version


@pytest.fixture
def folder(tmp_path, assets) -> Path:  # noqa: F811  (the fixture imported above)
    for name in ("configs", "examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    for name in ("path", "checkpoints", "report.json", "my_pkg"):
        (tmp_path / name).symlink_to(assets / name)
    venv_folder(tmp_path)
    return tmp_path


def _trains(command: str) -> bool:
    argv = shlex.split(command)
    return (
        argv[0] in ("accelerate", "torchrun")
        or (argv[0] == "python" and argv[1].startswith("examples/"))
        or (argv[:2] == ["fsdp-overlap", "launch"])
    )


@pytest.mark.slow
@pytest.mark.newest_torch
@pytest.mark.parametrize("command", RUN_HERE)
def test_the_readme_command_runs_in_a_new_shell(command, folder):
    before = {entry.name for entry in folder.iterdir()}
    done = new_shell(command, folder)
    text = done.stdout + done.stderr
    failure = f"$ {command}\n(exit code {done.returncode})\n{text[-6000:]}"
    if done.returncode < 0 and -done.returncode in NATIVE_CRASHES:
        count_crash(command)
        raise AssertionError(f"killed by {signal.Signals(-done.returncode).name}\n{failure}")
    raise_on_launcher_crash(text, failure, what=command)
    assert "command not found" not in text and "No module named" not in text, failure
    if command == "python benchmarks/gpu_check.py" and not torch.cuda.is_available():  # its refusal
        assert done.returncode == 2 and "no CUDA GPU is visible" in done.stderr, failure
        return
    assert done.returncode == 0, failure
    assert "Traceback" not in text, failure
    if _trains(command):
        summaries = re.findall(r"^fsdp-overlap summary: 2 ranks, .*both passes on$", text, flags=re.M)
        assert len(summaries) == 1, f"{len(summaries)} summaries\n{failure}"
    if command.startswith("fsdp-overlap export "):  # the assets' tied Llama: no lm_head.weight in the files
        assert (folder / shlex.split(command)[3] / "config.json").is_file(), failure
        assert _hf.head_storage_problems(folder / shlex.split(command)[3], "llama") == [], failure
    # what it wrote, typed in the clone's folder, is what .gitignore leaves out
    written = sorted({entry.name for entry in folder.iterdir()} - before)
    shown = [name for name in written if not ignored_in_the_clone(name)]
    assert shown == [], f"{command} leaves {shown} in the clone's folder, not in .gitignore"


def ignored_in_the_clone(name: str) -> bool:
    """``name`` (a folder or a file at the clone's top) is left out by its .gitignore."""
    for path in (f"{name}/", name):
        check = ["git", "-C", str(ROOT), "check-ignore", "--quiet", "--no-index", path]
        if subprocess.run(check, capture_output=True, check=False).returncode == 0:
            return True
    return False
