"""Accelerate adapter, no processes: configs/overlap.yaml, where workers find it, how its
keys become an OverlapConfig, the errors users see, and the Accelerate 1.15 facts the
design rests on (so an Accelerate upgrade that changes one of them is noticed)."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from _dist import run_isolated

from fsdp_overlap_plugin import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.accelerate import adapter as accelerate_prepare
from fsdp_overlap_plugin.accelerate import config as acfg
from fsdp_overlap_plugin.accelerate import load_config, plugin_keys, prepare, use_gloo_on_cpu_only_launch
from fsdp_overlap_plugin.accelerate.config import AccelerateSettings, ConfigSource, build_config, find_config_file
from fsdp_overlap_plugin.models import gpt_small

ROOT = Path(__file__).resolve().parents[2]
OVERLAP_YAML = ROOT / "configs" / "overlap.yaml"
LAUNCH_ENV = [
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_CPU",
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_DYNAMO_BACKEND",
    "FSDP_RESHARD_AFTER_FORWARD",
    "FSDP_ACTIVATION_CHECKPOINTING",
    "FSDP_SYNC_MODULE_STATES",
    "FSDP_VERSION",
    "FSDP_OFFLOAD_PARAMS",
    "FSDP_OVERLAP_CONFIG",
    "LOCAL_RANK",
    "WORLD_SIZE",
]


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch):
    """These tests run outside any launcher, whatever the shell exported."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def write(tmp_path: Path, data: dict, name: str = "overlap.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def overlap_yaml_with(**fsdp_changes) -> dict:
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["fsdp_config"].update(fsdp_changes)
    return data


# ------------------------------------------------------------------ configs/overlap.yaml
def test_overlap_yaml_has_one_plugin_key_per_overlap_config_field():
    text = OVERLAP_YAML.read_text()
    written = re.findall(r"^\s+(fsdp_overlap_\w+):", text, flags=re.M)
    assert sorted(written) == sorted(plugin_keys())  # no field missing, none twice, nothing extra
    assert len(plugin_keys()) == len(dataclasses.fields(OverlapConfig))
    assert set(yaml.safe_load(text)["fsdp_config"]) >= set(plugin_keys())  # all under fsdp_config


def test_accelerate_docs_name_every_plugin_key():
    """docs/accelerate.md holds the key list and the --config / --config_file story; the
    README's Accelerate section tells the short version and points at it."""
    page = (ROOT / "docs" / "accelerate.md").read_text()
    assert [key for key in plugin_keys() if f"`{key}`" not in page] == []
    assert "`--config`" in page and "--config_file" in page
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Accelerate") :].split("\n## ", 1)[0]
    assert "](docs/accelerate.md)" in section
    assert "`--config`" in section and "--config_file" in section


def test_overlap_yaml_documents_the_defaults():
    # The template shows every default, so a user sees what they would change.
    resolved = load_config(None, OVERLAP_YAML)
    assert resolved.config.to_dict() == OverlapConfig().to_dict()
    assert resolved.prefixed and resolved.source.path == OVERLAP_YAML


def test_overlap_yaml_is_a_valid_accelerate_config():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    cfg = ClusterConfig.from_yaml_file(str(OVERLAP_YAML))
    assert cfg.distributed_type == DistributedType.FSDP
    assert cfg.fsdp_config["fsdp_version"] == 2
    assert cfg.mixed_precision in ("no", "bf16", "fp16")
    assert isinstance(cfg.num_processes, int) and cfg.num_processes >= 1


def test_plugin_key_names():
    assert acfg.key_for("bucket_plans") == "fsdp_overlap_bucket_plans"
    assert acfg.key_for("overlap_grad_reduce") == "fsdp_overlap_grad_reduce"  # no "overlap_overlap"
    assert acfg.field_for("fsdp_overlap_grad_reduce") == "overlap_grad_reduce"
    assert acfg.field_for("fsdp_overlap_nope") is None


# ------------------------------------------------------------ Accelerate 1.15 facts
def _launch_args(*argv: str):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(list(argv))
    return _validate_launch_command(args)[0]


def test_fact_config_is_not_a_spelling_of_config_file(capsys):
    from accelerate.commands.launch import launch_command_parser

    with pytest.raises(SystemExit):  # allow_abbrev=False: no prefix matching
        launch_command_parser().parse_args(["--config", str(OVERLAP_YAML), "train.py"])
    assert "--config" in capsys.readouterr().err
    for spelling in ("--config_file", "--config-file"):
        assert launch_command_parser().parse_args([spelling, "x.yaml", "train.py"]).config_file == "x.yaml"


def test_fact_unknown_top_level_key_is_an_error(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig

    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["fsdp_overlap_bucket_plans"] = "auto"
    with pytest.raises(ValueError, match="unknown keys"):
        ClusterConfig.from_yaml_file(str(write(tmp_path, data)))


def test_fact_plugin_keys_never_reach_the_workers():
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = _launch_args("--config_file", str(OVERLAP_YAML), "--num_processes", "2", "train.py")
    env = prepare_multi_gpu_env(args)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    # what the launcher adds (the environment it copies may hold variables of its own, such
    # as .ci/run's FSDP_OVERLAP_CRASH_LOG)
    added = {k: v for k, v in env.items() if os.environ.get(k) != v}
    leaked = {k: v for k, v in added.items() if "OVERLAP" in k.upper() or "overlap.yaml" in v}
    assert leaked == {}  # neither the keys nor the file's path
    assert "training_script_args" in vars(args) and args.training_script_args == []


def test_fact_custom_dynamo_backend_is_rejected(tmp_path):
    from accelerate.utils.launch import prepare_multi_gpu_env

    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["dynamo_config"] = {"dynamo_backend": "fsdp_overlap"}
    args = _launch_args("--config_file", str(write(tmp_path, data)), "train.py")
    with pytest.raises(ValueError, match="Unknown dynamo backend"):
        prepare_multi_gpu_env(args)


def test_fact_cpu_flag_starts_one_process():
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    args = _launch_args("--config_file", str(OVERLAP_YAML), "--cpu", "--num_processes", "2", "train.py")
    assert args.cpu and args.use_fsdp  # launch_command then takes the simple launcher
    cmd, _ = prepare_simple_launcher_cmd_env(args)
    assert cmd == [sys.executable, "train.py"]  # one python process, whatever --num_processes says


# ----------------------------------------------------------------- finding the file
@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["/venv/bin/python3", "/venv/bin/accelerate", "launch", "--config_file", "a.yaml", "t.py"],
            ["--config_file", "a.yaml", "t.py"],
        ),
        (
            ["python", "-m", "accelerate.commands.launch", "--config-file", "a.yaml", "t.py"],
            ["--config-file", "a.yaml", "t.py"],
        ),
        (["python", "-m", "accelerate.commands.accelerate_cli", "launch", "t.py"], ["t.py"]),
        (["/usr/bin/accelerate-launch", "t.py"], ["t.py"]),
        (["/venv/bin/accelerate", "env"], None),
        (["torchrun", "--nproc-per-node", "2", "t.py"], None),
    ],
)
def test_launch_args(argv, expected):
    assert acfg.launch_args(argv) == expected


def fake_processes(table: dict[int, tuple[list[str], str, int]]):
    def read(pid):
        if pid not in table:
            return None
        argv, cwd, ppid = table[pid]
        return acfg._Process(argv, Path(cwd), ppid)

    return read


def test_launcher_config_file_is_read_from_an_ancestor_and_its_cwd(monkeypatch):
    monkeypatch.setattr(os, "getppid", lambda: 300)
    table = {
        300: (["/bin/bash", "-c", "run"], "/elsewhere", 200),  # a wrapper between launcher and worker
        200: (
            [
                "/venv/bin/python3",
                "/venv/bin/accelerate",
                "launch",
                "--config-file",
                "cfg/o.yaml",
                "--num_processes",
                "2",
                "t.py",
                "--config_file",
                "not_this.yaml",
            ],
            "/jobs/run1",
            1,
        ),
    }
    found = acfg.launcher_config_file(read_process=fake_processes(table))
    assert found.path == Path("/jobs/run1/cfg/o.yaml")  # relative to the launcher's cwd, not the script's args
    assert "pid 200" in found.found_by


def test_launcher_without_config_file_uses_accelerates_default(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "getppid", lambda: 200)
    table = {200: (["accelerate", "launch", "t.py"], "/jobs", 1)}
    default = write(tmp_path, {"distributed_type": "FSDP"}, "default_config.yaml")
    monkeypatch.setattr(acfg, "_default_accelerate_config", lambda: default)
    assert acfg.launcher_config_file(read_process=fake_processes(table)).path == default
    monkeypatch.setattr(acfg, "_default_accelerate_config", lambda: None)
    found = acfg.launcher_config_file(read_process=fake_processes(table))
    assert found.path is None and "no --config_file" in found.found_by


def test_find_config_file_order(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "getppid", lambda: 200)
    read = fake_processes({200: (["accelerate", "launch", "--config_file", "/l.yaml", "t.py"], "/", 1)})
    assert find_config_file(read_process=read) == ConfigSource(
        Path("/l.yaml"), "--config_file of accelerate launch (pid 200)"
    )
    monkeypatch.setenv("FSDP_OVERLAP_CONFIG", "/env.yaml")
    assert find_config_file(read_process=read).path == Path("/env.yaml")
    assert find_config_file("/explicit.yaml", read_process=read).path == Path("/explicit.yaml")
    monkeypatch.delenv("FSDP_OVERLAP_CONFIG")
    none = find_config_file(read_process=fake_processes({200: (["torchrun", "t.py"], "/", 1)}))
    assert none.path is None and "not started by accelerate launch" in str(none)


def test_this_process_is_not_an_accelerate_launch():
    # The real /proc reader, on pytest's own ancestors.
    assert acfg.launcher_config_file() is None
    info = acfg._read_process(os.getpid())
    assert info is not None and info.ppid == os.getppid() and any("pytest" in a for a in info.argv)


# ------------------------------------------------------------------ reading the file
def test_plain_plugin_yaml_is_accepted():
    resolved = load_config(None, ROOT / "configs" / "plugin.yaml")
    assert not resolved.prefixed and resolved.config.bucket_plans == "auto"


def test_fsdp_config_keys_without_fsdp_prefix_are_read_like_accelerate_reads_them(tmp_path):
    data = overlap_yaml_with()
    data["fsdp_config"]["overlap_backend"] = data["fsdp_config"].pop("fsdp_overlap_backend")
    data["fsdp_config"]["overlap_backend"] = "aot_eager"  # the launcher reads it as fsdp_overlap_backend
    assert load_config(None, write(tmp_path, data)).config.backend == "aot_eager"


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"fsdp_overlap_bucket_plan": "auto"},
            r"fsdp_config\.fsdp_overlap_bucket_plan: unknown fsdp-overlap key\. Did you mean 'fsdp_overlap_bucket_plans'",
        ),
        ({"fsdp_overlap_overlap_grad_reduce": True}, r"Did you mean 'fsdp_overlap_grad_reduce'"),
        (
            {"fsdp_overlapp_backend": "inductor"},
            r"fsdp_config\.fsdp_overlapp_backend: unknown key .*drop it silently.*Did you mean 'fsdp_overlap_backend'",
        ),
        (
            {"fsdp_overlap_manual_bucketing": "yes"},
            r"fsdp_config\.fsdp_overlap_manual_bucketing: expected true or false, got 'yes'",
        ),
        ({"fsdp_overlap_grad_reduce": 1}, r"fsdp_config\.fsdp_overlap_grad_reduce: expected true or false"),
        (
            {"fsdp_overlap_backend": "inductr"},
            r"fsdp_config\.fsdp_overlap_backend: unknown backend 'inductr'.*Did you mean 'inductor'",
        ),
        (
            {"fsdp_overlap_bucket_plans": "blocks.*"},
            r"fsdp_config\.fsdp_overlap_bucket_plans: expected \"auto\" or a list",
        ),
        ({"fsdp_overlap_mesh": {"shards": 2}}, r"unknown key 'mesh\.shards'.*Did you mean 'shard'"),
        ({"fsdp_overlap_param_dtype": "bfloat15"}, r"fsdp_overlap_param_dtype.*unknown dtype 'bfloat15'"),
    ],
)
def test_bad_yaml_names_the_key(tmp_path, change, message):
    path = write(tmp_path, overlap_yaml_with(**change))
    with pytest.raises(OverlapConfigError, match=message) as info:
        load_config(None, path)
    assert str(path) in str(info.value)


def test_plugin_key_at_top_level_is_explained(tmp_path):
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["fsdp_overlap_backend"] = "aot_eager"
    with pytest.raises(OverlapConfigError, match="go under fsdp_config.*rejects unknown top-level keys"):
        load_config(None, write(tmp_path, data))


# ------------------------------------------------------- Accelerate's keys and ours
def settings(**kw) -> AccelerateSettings:
    return AccelerateSettings(**kw, where={k: f"<{k}>" for k in kw})


def test_mixed_precision_sets_param_dtype():
    cfg = build_config({}, set(), settings(mixed_precision="bf16"))
    assert (cfg.param_dtype, cfg.torch_reduce_dtype) == ("bf16", torch.bfloat16)  # as Accelerate's FSDP2 policy
    cfg = build_config({"reduce_dtype": "fp32"}, {"reduce_dtype"}, settings(mixed_precision="bf16"))
    assert (cfg.param_dtype, cfg.reduce_dtype) == ("bf16", "fp32")  # a refinement, not a contradiction
    assert build_config({}, set(), settings(mixed_precision="no")).param_dtype is None


@pytest.mark.parametrize(
    "values, s, message",
    [
        (
            {"param_dtype": "fp16"},
            dict(mixed_precision="bf16"),
            r"param_dtype is 'fp16' but Accelerate's mixed_precision is 'bf16'",
        ),
        (
            {"param_dtype": "bf16"},
            dict(mixed_precision="no"),
            r"mixed_precision is 'no'.*Set mixed_precision to 'bf16'",
        ),
        ({}, dict(mixed_precision="fp8"), r"mixed_precision 'fp8'.*not supported.*valid: no, bf16, fp16"),
        (
            {"reshard_after_forward": False},
            dict(reshard_after_forward=True),
            r"reshard_after_forward is False but Accelerate's fsdp_reshard_after_forward is true",
        ),
        (
            {"activation_checkpointing": ["blocks.0"]},
            dict(activation_checkpointing=False),
            r"fsdp_activation_checkpointing is false",
        ),
        ({}, dict(fsdp_version=1), r"fsdp_version is 1.*set fsdp_version: 2"),
        ({}, dict(offload_params=True), r"fsdp_offload_params is true"),
        ({}, dict(dynamo_backend="INDUCTOR"), r"dynamo_backend is 'INDUCTOR'.*compiles the model itself"),
    ],
)
def test_accelerate_keys_and_plugin_keys_must_agree(values, s, message):
    with pytest.raises(OverlapConfigError, match=message):
        build_config(values, set(values), settings(**s), source="o.yaml")


def test_accelerate_keys_decide_what_the_plugin_leaves_out():
    model = gpt_small(n_layer=3)
    cfg = build_config({}, set(), settings(reshard_after_forward=False, activation_checkpointing=True), model=model)
    assert cfg.reshard_after_forward is False
    assert cfg.activation_checkpointing == ["blocks.0", "blocks.1", "blocks.2"]  # each repeated block
    cfg = build_config(
        {"activation_checkpointing": ["blocks.1"]},
        {"activation_checkpointing"},
        settings(activation_checkpointing=True),
        model=model,
    )
    assert cfg.activation_checkpointing == ["blocks.1"]
    with pytest.raises(OverlapConfigError, match="no repeated blocks"):
        build_config({}, set(), settings(activation_checkpointing=True), model=torch.nn.Linear(2, 2))


def test_settings_come_from_the_launcher_env_before_the_yaml(monkeypatch, tmp_path):
    path = write(tmp_path, overlap_yaml_with(fsdp_reshard_after_forward=True, fsdp_overlap_reshard_after_forward=True))
    assert load_config(None, path).config.reshard_after_forward is True
    # `accelerate launch --fsdp_reshard_after_forward false ...` exports the override:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    with pytest.raises(OverlapConfigError, match=r"\$FSDP_RESHARD_AFTER_FORWARD"):
        load_config(None, path)
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert load_config(None, path).config.param_dtype == "bf16"


# --------------------------------------------------- prepare(): errors before any collective
class FakeAccelerator:
    """Just what prepare() reads before it touches a process group."""

    def __init__(self, kind: str = "MULTI_CPU", processes: int = 2):
        from accelerate.utils import DistributedType, DynamoBackend

        self.distributed_type = DistributedType(kind)
        self.num_processes = processes
        self.mixed_precision = "no"
        self.parallelism_config = None
        self.state = types.SimpleNamespace(dynamo_plugin=types.SimpleNamespace(backend=DynamoBackend.NO))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"fsdp_overlap_bucket_plan": [["tok_emb"]]},
            r"fsdp_config\.fsdp_overlap_bucket_plan: unknown fsdp-overlap key",
        ),
        (
            {"fsdp_overlap_bucket_plans": [["tok_emb", "pos_emb"], "blocks.0", "blocks.9"]},
            r"fsdp_config\.fsdp_overlap_bucket_plans\[2\]: no module named 'blocks\.9'.*Did you mean 'blocks\.1'",
        ),
        (
            {"fsdp_overlap_reshard_last_bucket": "no"},
            r"fsdp_config\.fsdp_overlap_reshard_last_bucket: expected true or false",
        ),
        (
            {"fsdp_overlap_activation_checkpointing": ["blockz.*"]},
            r"fsdp_config\.fsdp_overlap_activation_checkpointing\[0\]: no module matches .blockz\.\*.",
        ),
    ],
)
def test_prepare_fails_before_touching_the_model(tmp_path, monkeypatch, change, message):
    if "fsdp_overlap_activation_checkpointing" in change:
        change["fsdp_activation_checkpointing"] = True
    path = write(tmp_path, overlap_yaml_with(**change))
    model = gpt_small(n_layer=2)
    before = {n: p for n, p in model.named_parameters()}

    def no_process_group_yet(*args, **kwargs):
        raise AssertionError("prepare() reached the process group before checking the config")

    monkeypatch.setattr(accelerate_prepare, "_ensure_process_group", no_process_group_yet)
    monkeypatch.setattr(accelerate_prepare, "build_mesh", no_process_group_yet)
    with pytest.raises(OverlapConfigError, match=message):
        prepare(FakeAccelerator(), model, torch.optim.SGD(model.parameters(), lr=0.1), config=path)
    assert dict(model.named_parameters()) == before


def test_prepare_refuses_what_it_cannot_do(monkeypatch):
    model = gpt_small(n_layer=2)
    with pytest.raises(ValueError, match="exactly one model"):
        prepare(FakeAccelerator(), model, gpt_small(n_layer=2))
    with pytest.raises(RuntimeError, match="cannot run under distributed_type DEEPSPEED"):
        prepare(FakeAccelerator("DEEPSPEED"), model)
    monkeypatch.setenv("WORLD_SIZE", "2")  # two workers, each Accelerator thinking it is alone:
    with pytest.raises(RuntimeError, match="ACCELERATE_USE_CPU=true"):
        prepare(FakeAccelerator("NO", processes=1), model)


# ---------------------------------------------------------------- CPU-only launches
def test_cpu_only_fsdp_launch_gets_gloo_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    # registered with monkeypatch first, so the value the function sets is undone too
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert not use_gloo_on_cpu_only_launch()  # not a worker of a launch
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert use_gloo_on_cpu_only_launch() and os.environ["ACCELERATE_USE_CPU"] == "true"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")  # the user's explicit choice stands
    assert not use_gloo_on_cpu_only_launch() and os.environ["ACCELERATE_USE_CPU"] == "false"


def _npu_launch_keeps_npu() -> tuple:
    from _fake_npu import install_fake_torch_npu

    install_fake_torch_npu(count=2)
    os.environ.update(LOCAL_RANK="1", ACCELERATE_USE_FSDP="true")
    os.environ.pop("ACCELERATE_USE_CPU", None)
    changed = use_gloo_on_cpu_only_launch()
    return changed, os.environ.get("ACCELERATE_USE_CPU")


def test_npu_launch_is_left_to_hccl():
    assert run_isolated(_npu_launch_keeps_npu) == (False, None)


# ----------------------------------------------------- adoption of Accelerate's accelerators
def test_the_adapter_wraps_accelerators_methods_once_keeping_their_signatures():
    import inspect

    import accelerate

    from fsdp_overlap_plugin.accelerate import adopt

    wrapped = {name: getattr(accelerate.Accelerator, name) for name in adopt._ORIGINALS}
    assert sorted(wrapped) == ["__init__", "clip_grad_norm_", "prepare", "prepare_model"]
    adopt.install()  # a second import, say: nothing wrapped twice
    for name, method in wrapped.items():
        assert getattr(accelerate.Accelerator, name) is method
        assert method.__wrapped__ is adopt._ORIGINALS[name]  # help() and inspect see Accelerate's
        assert inspect.signature(method) == inspect.signature(adopt._ORIGINALS[name])


def test_an_fsdp1_plugin_is_refused_naming_fsdp_version():
    from fsdp_overlap_plugin.accelerate import adopt

    with pytest.raises(OverlapConfigError, match=r"^fsdp_version: 1: fsdp-overlap keeps FSDP2's parameter layout"):
        adopt._check_version(types.SimpleNamespace(fsdp_version=1))


def _accelerator_outside_an_fsdp_launch():
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    from accelerate import Accelerator

    import fsdp_overlap_plugin.accelerate  # noqa: F401
    from fsdp_overlap_plugin.accelerate import is_adopted

    accelerator = Accelerator(cpu=True)
    model = gpt_small(n_layer=1, d_model=16, block_size=8)
    prepared = accelerator.prepare(model)  # Accelerate's own: one process, nothing to wrap
    return is_adopted(accelerator), accelerator.distributed_type.value, prepared is model


def test_an_accelerator_outside_an_fsdp_launch_is_left_to_accelerate():
    adopted, kind, same = run_isolated(_accelerator_outside_an_fsdp_launch)
    assert (adopted, kind, same) == (False, "NO", True)
