"""``fsdp-overlap launch``: our options split from ``accelerate launch``'s (the training script's
own arguments untouched), the check run on what the workers will see (world size, the
launcher's exported variables), exit 2 before any process on a bad YAML, and a real launch
that trains as ``accelerate launch --config_file`` does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from _accelerate import OVERLAP_YAML, ROOT, copy_yaml, fsdp_overlap, output

from fsdp_overlap_plugin.accelerate.config import launch_args, launcher_config_file
from fsdp_overlap_plugin.cli import commands, launch
from fsdp_overlap_plugin.cli import main as cli_main
from fsdp_overlap_plugin.cli.launch import RUNNER

CONFIG = "configs/overlap.yaml"
FSDP_OVERLAP = Path(sys.executable).with_name("fsdp-overlap")
GPT = ["--model", "fsdp_overlap_plugin.models.gpt:gpt_small", "--model-arg", "n_layer=4", "--model-arg", "d_model=64"]


@pytest.fixture
def launched(monkeypatch):
    """Stub the launcher: ``[(cmd, env)]`` of every launch; the root as working directory;
    no launcher variables inherited from the environment running the tests."""
    calls: list[tuple[list[str], dict[str, str]]] = []

    def fake_run(cmd, env):
        calls.append((cmd, env))
        return 0

    monkeypatch.setattr(launch, "_run", fake_run)
    monkeypatch.chdir(ROOT)
    for name in list(os.environ):
        if name.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)
    return calls


@pytest.fixture
def checked(monkeypatch):
    """The check's arguments and results: ``{"args": [Namespace], "results": [(code, out, lines)]}``."""
    seen: dict[str, list] = {"args": [], "results": []}
    real = commands.cmd_check

    def spy(args):
        seen["args"].append(args)
        seen["results"].append(real(args))
        return seen["results"][-1]

    monkeypatch.setattr(commands, "cmd_check", spy)
    return seen


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["launch", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------ splitting
def test_accelerate_itself_refuses_config():
    """The reason for the command: Accelerate's parser takes --config_file but not --config."""
    from accelerate.commands.launch import launch_command_parser

    assert launch_command_parser().parse_args(["--config_file", "a.yaml", "t.py"]).config_file == "a.yaml"
    with pytest.raises(SystemExit):
        launch_command_parser().parse_args(["--config", "a.yaml", "t.py"])


@pytest.mark.parametrize(
    "flag",
    [["--config", "a.yaml"], ["--config=a.yaml"], ["--config_file", "a.yaml"], ["--config-file", "a.yaml"]],
    ids=["config", "config=", "config_file", "config-file"],
)
def test_config_spellings_and_the_scripts_own_config_stays_with_it(flag):
    args = launch.split_args(
        ["--num_processes", "2", *flag, "--mixed_precision", "bf16", "train.py", "--config", "b.yaml", "--model", "m"]
    )
    assert args.config == "a.yaml" and args.model is None and not args.help
    assert args.passthrough == ["--num_processes", "2", "--mixed_precision", "bf16"] + [
        "train.py",
        "--config",
        "b.yaml",
        "--model",
        "m",
    ]


def test_options_that_take_a_value_are_found_with_accelerates_parser():
    # "2" and "host.py" are values, not the training script: --config after them is still ours;
    # --multi_gpu and -m take none: the token after -m is the script (a module), its --config its own.
    args = launch.split_args(
        ["--main_process_ip", "host.py", "-t", "3", "--multi_gpu", "--num-processes", "2", "--config", "a.yaml"]
        + ["--model=pkg:f", "--model-arg", "n=1", "--model_arg=k=v", "-m", "pkg.train", "--config", "b.yaml", "-h"]
    )
    assert (args.config, args.model, args.model_args, args.help) == ("a.yaml", "pkg:f", ["n=1", "k=v"], False)
    assert args.passthrough == [
        "--main_process_ip",
        "host.py",
        "-t",
        "3",
        "--multi_gpu",
        "--num-processes",
        "2",
        "-m",
        "pkg.train",
        "--config",
        "b.yaml",
        "-h",
    ]


@pytest.mark.parametrize(
    "flags",
    [
        ["--config", "a.yaml", "--config_file", "b.yaml"],
        ["--config-file=a.yaml", "--config", "a.yaml"],
        ["--config_file", "a.yaml", "--config_file", "b.yaml"],
    ],
)
def test_two_config_flags_exit_2(capsys, launched, flags):
    code, out, err = run(capsys, *flags, "--num_processes", "2", "train.py")
    assert code == 2 and out == "" and not launched
    assert err.startswith("fsdp-overlap launch: error: give the config once: ")
    first, second = flags[0].split("=")[0], flags[-2]
    assert f"once: {first} a.yaml and {second} " in err


def test_missing_config_exits_2_naming_the_flag(capsys, launched):
    code, out, err = run(capsys, "--num_processes", "2", "train.py", "--config", "b.yaml")
    assert code == 2 and out == "" and not launched
    assert err == (
        "fsdp-overlap launch: error: the Accelerate YAML is needed: --config CONFIG (or --config_file CONFIG) "
        "(a --config after the training script is the script's own)\n"
    )
    code, _, err = run(capsys, "train.py")
    assert code == 2 and "needed: --config CONFIG" in err and "script's own" not in err
    code, _, err = run(capsys, "--config")
    assert code == 2 and err == "fsdp-overlap launch: error: --config needs a value\n"
    code, _, err = run(capsys, "--config", CONFIG, "--model-arg", "n=1", "train.py")
    assert code == 2 and err == "fsdp-overlap launch: error: --model-arg needs --model\n"
    assert not launched


def test_help_before_the_script_only(capsys, launched):
    code, out, err = run(capsys, "--num_processes", "2", "--help", "train.py")
    assert code == 0 and err == "" and not launched
    assert out.startswith("usage: fsdp-overlap launch --config CONFIG") and "accelerate launch --help" in out
    assert launch.split_args(["-h"]).help
    assert launch.split_args(["--config", "a", "train.py", "--help"]).help is False  # the script's own


# ------------------------------------------------------------- what the check sees
@pytest.mark.parametrize("processes", [None, "3"])
def test_launcher_arguments_pass_through_and_reach_the_check(capsys, launched, checked, processes):
    world = ["--num_processes", processes] if processes else []
    code, out, err = run(
        capsys, "--config", CONFIG, *world, "--mixed_precision", "bf16", "train.py", "--config", "b.yaml", "--lr", "3"
    )
    assert code == 0, err
    [(cmd, env)] = launched
    assert cmd == [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG, *world] + [
        "--mixed_precision",
        "bf16",
        "-m",  # the script runs under python -m fsdp_overlap_plugin.accelerate: no import needed in it
        "fsdp_overlap_plugin.accelerate",
        "train.py",
        "--config",
        "b.yaml",
        "--lr",
        "3",
    ]
    assert env["FSDP_OVERLAP_CONFIG"] == str(OVERLAP_YAML)  # absolute: any worker directory finds it
    [args] = checked["args"]
    assert args.config == CONFIG and args.model is None
    assert args.world == (int(processes) if processes else None)  # None: the file's num_processes
    # what accelerate launch exports to the workers, beside the file
    assert args.environ["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert args.environ["ACCELERATE_USE_FSDP"] == "true"
    assert args.environ["FSDP_RESHARD_AFTER_FORWARD"] == "true"  # the file's, as exported
    assert checked["results"][0][1]["config"]["values"]["param_dtype"] == "bf16"
    assert out.splitlines() == [
        f"fsdp-overlap launch: {CONFIG}: keys valid; plan not checked against a model "
        "(pass --model pkg.mod:factory to check it before launching)",
        "  note: param_dtype = bf16 from mixed_precision: bf16",
        "  note: reshard_after_forward = true from fsdp_reshard_after_forward",
        f"fsdp-overlap launch: accelerate launch --config_file {CONFIG} {' '.join(cmd[5:])}",
    ]


def test_the_world_size_reaches_the_plan_check(capsys, launched, checked):
    code, out, err = run(capsys, "--config", CONFIG, *GPT, "--num_processes", "4", "train.py")
    assert code == 0, err
    [args] = checked["args"]
    assert (args.model, args.model_arg, args.world) == (GPT[1], ["n_layer=4", "d_model=64"], 4)
    result = checked["results"][0][1]
    assert result["memory"]["world"] == 4
    assert len(result["plan"]["buckets"]) == 6
    assert out.splitlines()[0] == (
        f"fsdp-overlap launch: {CONFIG}: OK: 6 buckets, 1 warning; passes on: manual_bucketing, overlap_grad_reduce"
    )
    assert launched


def test_an_fsdp_flag_that_contradicts_the_yaml_stops_before_launch(capsys, launched, tmp_path):
    # overlap.yaml sets fsdp_overlap_reshard_after_forward: true; the flag overrides Accelerate's key
    code, out, err = run(capsys, "--config", CONFIG, "--fsdp_reshard_after_forward", "false", "train.py")
    assert code == 2 and out == "" and not launched
    assert err.startswith("fsdp-overlap launch: error: configs/overlap.yaml: ")
    assert (
        "fsdp_config.fsdp_overlap_reshard_after_forward is True but Accelerate's fsdp_reshard_after_forward is "
        "false (fsdp_reshard_after_forward, as accelerate launch passed it ($FSDP_RESHARD_AFTER_FORWARD))" in err
    )
    # without the plugin's copy of the key the flag decides, as it will in the workers
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    del data["fsdp_config"]["fsdp_overlap_reshard_after_forward"]
    (tmp_path / "free.yaml").write_text(yaml.safe_dump(data))
    code, out, err = run(capsys, "--config", str(tmp_path / "free.yaml"), "--fsdp_reshard_after_forward", "false", "t")
    assert code == 0, err
    assert "  note: reshard_after_forward = false from fsdp_reshard_after_forward" in out.splitlines()
    assert len(launched) == 1


def test_the_fallback_mapping_agrees_with_accelerate(monkeypatch, launched):
    flags = ["--mixed_precision", "bf16", "--fsdp_reshard_after_forward", "false"]
    flags += ["--fsdp-activation-checkpointing", "true", "--num_processes", "2", "train.py", "--mixed_precision", "x"]
    real = launch.launcher_environ(CONFIG, flags)

    def refuse(args):
        raise RuntimeError("no such device")

    monkeypatch.setattr(launch, "_accelerate_environ", refuse)
    mapped = launch.launcher_environ(CONFIG, flags)
    expected = {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
    }
    assert mapped == expected
    assert {k: real[k] for k in expected} == expected
    assert real["FSDP_VERSION"] == "2" and real["FSDP_SYNC_MODULE_STATES"] == "true"  # the file's, exported too


def test_a_launcher_argument_accelerate_refuses_exits_2(capsys, launched):
    code, out, err = run(capsys, "--config", CONFIG, "--num_procs", "2", "train.py")
    assert code == 2 and out == "" and not launched
    assert err.startswith("fsdp-overlap launch: error: accelerate launch would refuse these arguments: ")
    assert "unrecognized arguments: --num_procs" in err


def test_only_an_accelerate_yaml_is_launched(capsys, launched):
    code, out, err = run(capsys, "--config", "configs/plugin.yaml", "train.py")
    assert code == 2 and out == "" and not launched
    assert "configs/plugin.yaml: a plugin YAML, not an Accelerate YAML" in err


def test_model_plan_errors_need_the_model(capsys, launched, tmp_path):
    bad = copy_yaml(tmp_path / "plan.yaml", fsdp_overlap_bucket_plans=[["tok_emb", "pos_emb"], "blocks.*", "heads"])
    code, out, err = run(capsys, "--config", str(bad), *GPT, "train.py")
    assert code == 2 and out == "" and not launched
    assert (
        f"fsdp-overlap launch: error: {bad}: fsdp_config.fsdp_overlap_bucket_plans[2]: no module named 'heads'" in err
    )
    code, _, err = run(capsys, "--config", str(bad), "train.py")  # keys alone are valid
    assert code == 0, err
    assert len(launched) == 1


def test_the_launchers_exit_code_is_ours(capsys, launched, monkeypatch):
    monkeypatch.setattr(launch, "_run", lambda cmd, env: 7)
    assert run(capsys, "--config", CONFIG, "train.py")[0] == 7


@pytest.mark.parametrize(
    ("given", "started"),
    [
        (["--num_processes", "2", "t.py", "-m", "x"], ["--num_processes", "2", "-m", RUNNER, "t.py", "-m", "x"]),
        (["-m", "pkg.train", "--lr", "3"], ["-m", RUNNER, "-m", "pkg.train", "--lr", "3"]),
        (["--", "t.py", "--lr", "3"], ["-m", "--", RUNNER, "t.py", "--lr", "3"]),
        (["--no_python", "./train.sh"], ["--no_python", "./train.sh"]),  # not a Python script: as given
        (["--num_processes", "2"], ["--num_processes", "2"]),  # no script: the launcher says so
    ],
)
def test_the_script_starts_under_the_plugins_runner(given, started):
    args = launch.split_args(["--config", "c.yaml", *given])
    assert launch.through_plugin(args.passthrough, args.script_at) == started
    # accelerate launch reads it as intended: the runner is the script, the rest its arguments
    if started != given:
        parsed = launch._parse_launcher("c.yaml", started)
        assert parsed.module and parsed.training_script == RUNNER


def test_worker_config_discovery_recognises_the_launcher_command():
    cmd = launch.launcher_command("c.yaml", ["--num_processes", "2", "t.py", "--config_file", "other.yaml"])
    assert launch_args(cmd) == ["--config_file", "c.yaml", "--num_processes", "2", "t.py"] + [
        "--config_file",
        "other.yaml",
    ]
    process = SimpleNamespace(argv=cmd, cwd=Path("/jobs/a"), ppid=1)
    found = launcher_config_file(10, read_process=lambda pid: process if pid == 10 else None)
    assert found is not None and found.path == Path("/jobs/a/c.yaml")
    assert found.found_by == "--config_file of accelerate launch (pid 10)"


# --------------------------------------------------------------------- signals
_CHILD = """
import pathlib, signal, sys, time
if sys.argv[2] == "handle":
    signal.signal(signal.SIGINT, lambda s, f: (pathlib.Path(sys.argv[1], "got").write_text(str(s)), sys.exit(7)))
    signal.signal(signal.SIGTERM, lambda s, f: (pathlib.Path(sys.argv[1], "got").write_text(str(s)), sys.exit(7)))
pathlib.Path(sys.argv[1], "ready").write_text("")
time.sleep(120)
"""

_DRIVER = """
import os, sys
from fsdp_overlap_plugin.cli.launch import _run
sys.exit(_run([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], dict(os.environ)))
"""


@pytest.mark.slow  # two Python processes a case
@pytest.mark.parametrize(
    "sig, child, code",
    [(signal.SIGTERM, "handle", 7), (signal.SIGINT, "default", 128 + signal.SIGINT)],
    ids=["term-handled", "int-not-from-a-terminal-kills"],
)
def test_signals_reach_the_launcher_and_its_code_is_returned(tmp_path, sig, child, code):
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, _CHILD, str(tmp_path), child],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert driver.poll() is None and time.monotonic() < deadline, driver.stdout.read()
            time.sleep(0.1)
        os.kill(driver.pid, sig)
        assert driver.wait(timeout=60) == code
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    if child == "handle":
        assert (tmp_path / "got").read_text() == str(int(sig))


# --------------------------------------------------------------- the real command
_SCRIPT = """
import json, os, pathlib, sys
keys = ("RANK", "WORLD_SIZE", "FSDP_OVERLAP_CONFIG", "ACCELERATE_MIXED_PRECISION")
pathlib.Path(f"started.{os.environ['RANK']}").write_text(json.dumps([sys.argv[1:], [os.environ.get(k) for k in keys]]))
"""


@pytest.mark.parametrize("good", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["bad-yaml", "good-yaml"])
def test_console_script_checks_before_any_worker_starts(tmp_path, good):
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    if not good:  # fsdp_overlap_grad_reduce misspelt
        data["fsdp_config"]["fsdp_overlap_overlap_grad_reduce"] = data["fsdp_config"].pop("fsdp_overlap_grad_reduce")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (tmp_path / "script.py").write_text(_SCRIPT)
    flags = ["--num_processes", "2", "--mixed_precision", "bf16", "script.py", "--config", "own.yaml"]
    proc = fsdp_overlap("launch", "--config", "job.yaml", *flags, cwd=tmp_path)
    started = sorted(p.name for p in tmp_path.glob("started.*"))
    if not good:
        assert proc.returncode == 2, output(proc)
        assert proc.stderr.startswith(
            "fsdp-overlap launch: error: job.yaml: fsdp_config.fsdp_overlap_overlap_grad_reduce: unknown fsdp-overlap "
            "key. Did you mean 'fsdp_overlap_grad_reduce'"
        )
        assert proc.stdout == "" and started == []  # no launcher, no worker
        return
    assert proc.returncode == 0, output(proc)[-4000:]
    assert started == ["started.0", "started.1"]
    for rank in (0, 1):
        argv, env = json.loads((tmp_path / f"started.{rank}").read_text())
        assert argv == ["--config", "own.yaml"]  # the script's own, unchanged
        assert env == [str(rank), "2", str(tmp_path / "job.yaml"), "bf16"]
