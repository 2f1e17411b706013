"""HSDP configured the way users already say it (issue 43), no processes: Accelerate's
``fsdp_sharding_strategy: HYBRID_SHARD`` and ``parallelism_config`` dp sizes, Lightning's
``sharding_strategy="HYBRID_SHARD"`` (nodes x devices) and ``device_mesh=(R, S)``, the
plugin's ``mesh`` key; contradictions and unsupported values are errors naming the keys.
The 2-rank runs of each spelling are in tests/runtime/integration/test_hsdp_accumulation.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fsdp_overlap_plugin import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.accelerate import load_config
from fsdp_overlap_plugin.config.schema import MeshConfig
from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy, FSDPOverlapStrategy
from fsdp_overlap_plugin.lightning._common import resolve_mesh

ROOT = Path(__file__).resolve().parents[2]
OVERLAP_YAML = ROOT / "configs" / "overlap.yaml"
LAUNCH_ENV = [
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_PARALLELISM_CONFIG",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "FSDP_SHARDING_STRATEGY",
    "FSDP_OVERLAP_CONFIG",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
]


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def _yaml(tmp_path: Path, top: dict | None = None, **fsdp) -> Path:
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["fsdp_config"].update(fsdp)
    data.update(top or {})
    path = tmp_path / "acc.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _mesh(config: OverlapConfig) -> tuple[int, int]:
    return config.mesh.replicate, config.mesh.shard


# ------------------------------------------------------------------------ Accelerate
def test_hybrid_shard_replicates_over_the_machines_of_the_file(tmp_path):
    path = _yaml(tmp_path, {"num_machines": 2, "num_processes": 8}, fsdp_sharding_strategy="HYBRID_SHARD")
    assert _mesh(load_config(None, path, environ={}).config) == (2, -1)  # shard: the processes of a machine


def test_hybrid_shard_replicates_over_the_machines_torchrun_reports(tmp_path):
    env = {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_SHARDING_STRATEGY": "HYBRID_SHARD",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert _mesh(load_config(None, _yaml(tmp_path), environ=env).config) == (4, -1)
    # the launcher exports FULL_SHARD when nothing is set: the mesh is the plugin's
    env["FSDP_SHARDING_STRATEGY"] = "FULL_SHARD"
    assert _mesh(load_config(None, _yaml(tmp_path), environ=env).config) == (1, -1)
    # its numbers (1-based, FSDP1's ShardingStrategy) mean the same
    env["FSDP_SHARDING_STRATEGY"] = "4"
    assert _mesh(load_config(None, _yaml(tmp_path), environ=env).config) == (4, -1)


def test_parallelism_config_sets_the_mesh(tmp_path):
    sizes = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 4}
    path = _yaml(tmp_path, {"parallelism_config": sizes})
    assert _mesh(load_config(None, path, environ={}).config) == (2, 4)
    env = {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "3",
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
    }
    assert _mesh(load_config(None, path, environ=env).config) == (3, 2)  # the launcher's values first
    # an agreeing plugin key is fine; the same HYBRID_SHARD machine count too
    agreeing = _yaml(
        tmp_path,
        {"parallelism_config": sizes, "num_machines": 2},
        fsdp_overlap_mesh={"replicate": 2, "shard": -1},
        fsdp_sharding_strategy="HYBRID_SHARD",
    )
    assert _mesh(load_config(None, agreeing, environ={}).config) == (2, 4)


@pytest.mark.parametrize(
    "top, fsdp, message",
    [
        (
            {"parallelism_config": {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 4}},
            {"fsdp_overlap_mesh": {"replicate": 1, "shard": 8}},
            r"fsdp_config\.fsdp_overlap_mesh is .*parallelism_config_dp_replicate_size=2.*must agree",
        ),
        (
            {"num_machines": 2, "num_processes": 4},
            {"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_overlap_mesh": {"replicate": 4, "shard": 1}},
            r"fsdp_config\.fsdp_overlap_mesh is .*fsdp_sharding_strategy is HYBRID_SHARD .*must agree",
        ),
        (
            {
                "num_machines": 2,
                "parallelism_config": {
                    "parallelism_config_dp_replicate_size": 4,
                    "parallelism_config_dp_shard_size": 2,
                },
            },
            {"fsdp_sharding_strategy": "HYBRID_SHARD"},
            r"fsdp_sharding_strategy is HYBRID_SHARD .*parallelism_config_dp_replicate_size=4.*must agree",
        ),
        (
            {},
            {"fsdp_sharding_strategy": "SHARD_GRAD_OP"},
            r"fsdp_sharding_strategy: 'SHARD_GRAD_OP' is not supported.*valid: FULL_SHARD, HYBRID_SHARD.*"
            r"fsdp_reshard_after_forward: false",
        ),
        (
            {},
            {"fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2"},
            r"valid: FULL_SHARD, HYBRID_SHARD\. .*HYBRID_SHARD with fsdp_reshard_after_forward: false",
        ),
        ({}, {"fsdp_sharding_strategy": "NO_SHARD"}, r"'NO_SHARD'.*parallelism_config_dp_replicate_size"),
        ({}, {"fsdp_sharding_strategy": "HYBRID"}, r"'HYBRID' is not a sharding strategy; valid: FULL_SHARD"),
        (
            {},
            {"fsdp_reshard_after_forward": "HYBRID_SHARD"},
            r"fsdp_reshard_after_forward: 'HYBRID_SHARD' is a sharding strategy.*fsdp_sharding_strategy: HYBRID_SHARD",
        ),
        (
            {"parallelism_config": {"parallelism_config_dp_replicate_size": 2, "parallelism_config_cp_size": 2}},
            {},
            r"parallelism_config_cp_size is 2 .*does not split sequences.*valid: .*parallelism_config_tp_size",
        ),
        (
            {"parallelism_config": {"dp_replicate_size": 2}},
            {},
            r"parallelism_config\.dp_replicate_size: unknown key .*parallelism_config_dp_replicate_size",
        ),
        (
            {"parallelism_config": {"parallelism_config_dp_replicate_size": 0}},
            {},
            r"parallelism_config_dp_replicate_size: expected an integer >= 1, got 0",
        ),
    ],
)
def test_accelerate_mesh_errors_name_the_keys(tmp_path, top, fsdp, message):
    with pytest.raises(OverlapConfigError, match=message):
        load_config(None, _yaml(tmp_path, top, **fsdp), environ={})


def test_the_accelerators_parallelism_config_decides(tmp_path):
    """What the live Accelerator holds comes before the launcher's variables and the file."""

    class Parallelism:
        dp_replicate_size, dp_shard_size, tp_size, cp_size, sp_size = 2, 2, 1, 1, 1

    class Accelerator:
        parallelism_config = Parallelism()
        mixed_precision = "no"
        state = None

    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "4"}
    assert _mesh(load_config(Accelerator(), _yaml(tmp_path), environ=env).config) == (2, 2)


def _sizes(config: OverlapConfig) -> tuple[int, int, int]:
    return config.mesh.replicate, config.mesh.shard, config.mesh.tensor


PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}


@pytest.mark.parametrize(
    "top, fsdp, env, live, expected",
    [
        # the YAML's section, as `fsdp-overlap check` reads it
        (
            {"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2}},
            {},
            {},
            None,
            (1, 2, 2),
        ),
        # what accelerate launch exported wins over the file
        (
            {"parallelism_config": {"parallelism_config_tp_size": 4}},
            {},
            {
                "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
                "PARALLELISM_CONFIG_TP_SIZE": "2",
            },
            None,
            (1, 2, 2),
        ),
        # the live ParallelismConfig wins over both; HSDP x TP
        (
            {},
            {},
            {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "4"},
            (2, 2, 2),
            (2, 2, 2),
        ),
        # the plugin's own mesh.tensor agreeing with Accelerate's
        (
            {"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2}},
            {"fsdp_overlap_mesh": {"tensor": 2}},
            {},
            None,
            (1, 2, 2),
        ),
    ],
)
def test_accelerates_tp_size_is_the_tensor_dimension(tmp_path, top, fsdp, env, live, expected):
    accelerator = None
    if live is not None:

        class Parallelism:
            dp_replicate_size, dp_shard_size, tp_size = live
            cp_size = sp_size = 1

        class Accelerator:
            parallelism_config = Parallelism()
            mixed_precision = "no"
            state = None

        accelerator = Accelerator()
    path = _yaml(tmp_path, top, fsdp_overlap_tp_plan=PLAN, **fsdp)
    assert _sizes(load_config(accelerator, path, environ=env).config) == expected


@pytest.mark.parametrize(
    "top, fsdp, message",
    [
        (
            {},
            {"fsdp_overlap_mesh": {"tensor": 2}, "fsdp_overlap_tp_plan": PLAN},
            r"fsdp_overlap_mesh: tensor is 2, but Accelerate's parallelism_config has no tp_size; set "
            r"parallelism_config_tp_size: 2",
        ),
        ({}, {"fsdp_overlap_tp_plan": PLAN}, r"fsdp_overlap_tp_plan splits modules .* set parallelism_config_tp_size"),
        (
            {"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 4}},
            {"fsdp_overlap_mesh": {"tensor": 2}, "fsdp_overlap_tp_plan": PLAN},
            r"fsdp_overlap_mesh is \{'tensor': 2\} but Accelerate's parallelism_config_tp_size=4 \(parallelism_config "
            r"in .*\); the two must agree",
        ),
    ],
)
def test_accelerate_tensor_parallel_errors_name_both_keys(tmp_path, top, fsdp, message):
    with pytest.raises(OverlapConfigError, match=message):
        load_config(None, _yaml(tmp_path, top, **fsdp), environ={})


# ------------------------------------------------------------------------- Lightning
@pytest.mark.parametrize(
    "strategy, device_mesh, mesh, nodes, devices, expected",
    [
        ("HYBRID_SHARD", None, None, 2, 4, (2, 4)),
        ("hybrid_shard", None, {"replicate": 2}, 2, 4, (2, 4)),  # agreeing mesh=, any case
        (None, (2, 1), None, 1, 2, (2, 1)),
        ("HYBRID_SHARD", (4, 2), None, 2, 4, (4, 2)),  # device_mesh decides, as in Lightning
        (None, (2, 2), {"replicate": 2, "shard": 2}, 1, 4, (2, 2)),
        ("FULL_SHARD", None, None, 2, 4, (1, -1)),
        (None, None, {"replicate": 2}, 2, 4, (2, -1)),  # the plugin's key alone
    ],
)
def test_lightning_mesh_from_nodes_and_devices(strategy, device_mesh, mesh, nodes, devices, expected):
    config = OverlapConfig(mesh=MeshConfig(**mesh)) if mesh else OverlapConfig()
    assert _mesh(resolve_mesh(config, strategy, device_mesh, nodes, devices)) == expected


@pytest.mark.parametrize(
    "strategy, device_mesh, mesh, message",
    [
        ("HYBRID_SHARD", None, {"replicate": 3}, r"sharding_strategy='HYBRID_SHARD' replicates over the 2 node.*mesh="),
        (None, (2, 2), {"replicate": 4}, r"device_mesh=\(2, 2\) contradicts mesh="),
        ("FULL_SHARD", (2, 2), None, r"device_mesh=\(2, 2\) replicates .* sharding_strategy='FULL_SHARD'"),
        ("FULL_SHARD", None, {"replicate": 2}, r"sharding_strategy='FULL_SHARD' .* mesh.replicate is 2"),
        ("SHARD_GRAD_OP", None, None, r"sharding_strategy='SHARD_GRAD_OP' is not supported.*valid: FULL_SHARD, "),
        ("NO_SHARD", None, None, r"valid: FULL_SHARD, HYBRID_SHARD\. mesh=\{'replicate': <world size>"),
        ("HYBRD_SHARD", None, None, r"'HYBRD_SHARD' is not one of FULL_SHARD, HYBRID_SHARD.*HYBRID_SHARD"),
        (None, (2,), None, r"device_mesh: expected a tuple \(replicate, shard\)"),
        (None, (2, 0), None, r"device_mesh: expected a tuple"),
    ],
)
def test_lightning_mesh_errors_name_both(strategy, device_mesh, mesh, message):
    config = OverlapConfig(mesh=MeshConfig(**mesh)) if mesh else OverlapConfig()
    with pytest.raises(OverlapConfigError, match=message):
        resolve_mesh(config, strategy, device_mesh, 2, 4)


@pytest.mark.parametrize("cls", [FSDPOverlapStrategy, FSDPOverlapFabricStrategy])
def test_strategies_check_the_mesh_spellings_at_construction(cls):
    with pytest.raises(OverlapConfigError, match="sharding_strategy='SHARD_GRAD_OP'"):
        cls(sharding_strategy="SHARD_GRAD_OP")
    with pytest.raises(OverlapConfigError, match=re.escape("device_mesh=(2, 2) contradicts mesh=")):
        cls(device_mesh=(2, 2), mesh={"replicate": 4})


def test_trainer_resolves_hybrid_shard_from_num_nodes_and_devices():
    from lightning.pytorch import Trainer

    strategy = FSDPOverlapStrategy(sharding_strategy="HYBRID_SHARD")
    Trainer(strategy=strategy, accelerator="cpu", devices=3, num_nodes=2, logger=False)
    assert _mesh(strategy._config_with_mesh()) == (2, 3)
    # a contradiction fails at Trainer(...), before any process starts
    with pytest.raises(OverlapConfigError, match=r"num_nodes=2, devices=3\), but mesh="):
        Trainer(
            strategy=FSDPOverlapStrategy(sharding_strategy="HYBRID_SHARD", mesh={"replicate": 3}),
            accelerator="cpu",
            devices=3,
            num_nodes=2,
            logger=False,
        )


def test_fabric_resolves_hybrid_shard_from_num_nodes_and_devices():
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=FSDPOverlapFabricStrategy(sharding_strategy="HYBRID_SHARD"), devices=2, num_nodes=3)
    assert _mesh(fabric.strategy._config_with_mesh()) == (3, 2)


def test_lightning_cli_yaml_check_resolves_hybrid_shard():
    """What ``fsdp-overlap check`` says of a LightningCLI file: the mesh the Trainer builds."""
    from fsdp_overlap_plugin.lightning.config import read_lightning_yaml

    strategy = {"class_path": "fsdp_overlap_plugin.lightning.FSDPOverlapStrategy"}
    data = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "num_nodes": 3,
            "strategy": {**strategy, "init_args": {"sharding_strategy": "HYBRID_SHARD"}},
        }
    }
    assert _mesh(read_lightning_yaml(data, "cli.yaml").config) == (3, 2)
    data["trainer"]["strategy"]["init_args"]["mesh"] = {"replicate": 2}
    with pytest.raises(OverlapConfigError, match=r"cli.yaml: .*HYBRID_SHARD.*num_nodes=3, devices=2\), but mesh="):
        read_lightning_yaml(data, "cli.yaml")
