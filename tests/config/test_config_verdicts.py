"""One truth: ``fsdp-overlap check`` and the runtime give every config file the same verdict.

Every YAML under tests/fixtures/configs/ (and every shipped config in configs/) goes
through both:

* ``check``: ``fsdp-overlap check FILE --model MODEL --json``, in process;
* the runtime, as a job would meet the file, on the meta device with a fake process group
  of the file's world size:
    - plugin YAML: ``parallelize(model, FILE)``;
    - Accelerate YAML: what ``accelerate.prepare`` does before it needs an ``Accelerator``
      (``accelerate.adapter.configure``: the config the worker reads, the plan and
      checkpointing checks), then ``parallelize`` on the mesh ``prepare`` builds;
    - LightningCLI YAML: ``examples/lightning_gpt.py``'s LightningCLI (``run=False``) builds the
      Trainer, then the strategy's own ``setup_environment`` and ``setup`` (what ``fit`` runs
      before the first step: precision, mesh, ``parallelize``).

Each fixture's first comment lines say what it is: ``# verdict: ok`` or ``# verdict: error
KEY`` (KEY as the file spells it), and optionally ``# world: N``. For a bad file both must
fail and both messages must name KEY (the runtime's message may name only its last part:
Lightning's parser says ``'presicion'``, not ``trainer.presicion``); for a good one both must
succeed, and the config and plan ``check`` prints must be the ones the runtime uses. A rule
added to one side only fails here.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from _fake import fake_world

from fsdp_overlap_plugin.cli import main
from fsdp_overlap_plugin.config.parse import MAX_CONFIG_BYTES
from fsdp_overlap_plugin.config.schema import OverlapConfigError
from fsdp_overlap_plugin.models.gpt import gpt_small

ROOT = Path(__file__).resolve().parents[2]
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
MODEL = "fsdp_overlap_plugin.models.gpt:gpt_small"
LIGHTNING_MODEL = f"{ROOT / 'examples' / 'lightning_gpt.py'}:GPTLitModule"
SHIPPED = {"overlap.yaml": "accelerate", "plugin.yaml": "plugin", "lightning.yaml": "lightning"}


@dataclass
class Case:
    path: Path
    shape: str  # plugin | accelerate | lightning: how the runtime meets the file
    error: str | None  # the key a bad file must be named by, None for a good one
    world: int

    @property
    def id(self) -> str:
        return self.path.name


def _header(path: Path) -> dict[str, str]:
    fields = {}
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("#"):
            break
        key, _, value = line[1:].strip().partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _world(path: Path, shape: str, header: dict[str, str]) -> int:
    if "world" in header:
        return int(header["world"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return 2
    if shape == "accelerate" and isinstance(data.get("num_processes"), int):
        return data["num_processes"]
    trainer = data.get("trainer") if isinstance(data, dict) else None
    if shape == "lightning" and isinstance(trainer, dict) and isinstance(trainer.get("devices"), int):
        return trainer["devices"] * int(trainer.get("num_nodes", 1))
    return 2


def corpus() -> list[Case]:
    cases = []
    for path in sorted(CORPUS.glob("*.yaml")):
        shape = path.name.split("_", 1)[0]
        header = _header(path)
        verdict = header["verdict"]
        error = None if verdict == "ok" else verdict.removeprefix("error").strip()
        cases.append(Case(path, shape, error, _world(path, shape, header)))
    for name, shape in SHIPPED.items():
        path = ROOT / "configs" / name
        cases.append(Case(path, shape, None, _world(path, shape, {})))
    return cases


CASES = corpus()


# ------------------------------------------------------------------------------ check
def check(case: Case, model: str, model_args: list[str]) -> tuple[int, dict]:
    argv = ["check", str(case.path), "--model", model, "--world", str(case.world), "--json"]
    for arg in model_args:
        argv += ["--model-arg", arg]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    return code, json.loads(out.getvalue())


# ---------------------------------------------------------------------------- runtime
@dataclass
class Outcome:
    error: str | None = None
    config: dict | None = None
    plan: list | None = None


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return gpt_small()


def run_plugin(path: Path) -> Outcome:
    from fsdp_overlap_plugin import parallelize
    from fsdp_overlap_plugin.runtime.state import get_state

    model = parallelize(_meta_gpt(), str(path))
    state = get_state(model)
    return Outcome(config=state.config.to_dict(), plan=state.plan)


def run_accelerate(path: Path) -> Outcome:
    from fsdp_overlap_plugin import parallelize
    from fsdp_overlap_plugin.accelerate.adapter import configure
    from fsdp_overlap_plugin.runtime.state import get_state
    from fsdp_overlap_plugin.shard.sharding import build_mesh

    model = _meta_gpt()
    # the worker's environment holds what accelerate launch exported: the file's values
    resolved = configure(None, model, str(path), environ={})
    try:
        parallelize(model, resolved.config, mesh=build_mesh(resolved.config, "cpu"))
    except OverlapConfigError as exc:  # as prepare() re-raises it
        raise resolved.rename(exc) from None
    return Outcome(config=resolved.config.to_dict(), plan=get_state(model).plan)


def run_lightning(path: Path) -> Outcome:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import lightning_gpt
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from fsdp_overlap_plugin.runtime.state import get_state

    err = io.StringIO()
    # no global seeding: LightningCLI's seed_everything would leave PL_GLOBAL_SEED in this
    # process's environment, and every later test's ranks would reseed from it
    args = ["--config", str(path), "--seed_everything=false"]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli = lightning_gpt.cli_main(args, run=False)
    except SystemExit as exc:  # LightningCLI's parser prints its error and exits 2
        raise RuntimeError(err.getvalue()) from exc
    trainer, strategy = cli.trainer, cli.trainer.strategy
    strategy.connect(cli.model)  # what fit() does, then the strategy's own hooks up to the first step
    strategy.setup_environment()
    strategy.setup(trainer)
    return Outcome(config=strategy.overlap_config.to_dict(), plan=get_state(strategy._parallelized).plan)


RUNTIME = {"plugin": run_plugin, "accelerate": run_accelerate, "lightning": run_lightning}


def runtime(case: Case) -> Outcome:
    with fake_world(case.world):
        try:
            return RUNTIME[case.shape](case.path)
        except Exception as exc:  # noqa: BLE001 - any refusal is the runtime's verdict
            return Outcome(error=f"{type(exc).__name__}: {exc}")


def _model_for(case: Case) -> tuple[str, list[str]]:
    """The model the runtime builds, as ``check`` is told it (a user passes --model)."""
    if case.shape != "lightning":
        return MODEL, []
    try:
        data = yaml.safe_load(case.path.read_text()) or {}
    except yaml.YAMLError:
        data = {}
    section = data.get("model") if isinstance(data, dict) else None
    return LIGHTNING_MODEL, [f"{k}={json.dumps(v)}" for k, v in (section or {}).items()]


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_check_and_runtime_agree(case, monkeypatch):
    monkeypatch.chdir(ROOT)
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # restored (removed) after the test, whatever ran
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # LightningCLI reads only its args=
    code, out = check(case, *_model_for(case))
    outcome = runtime(case)
    if case.error is None:
        assert outcome.error is None, f"the runtime refuses a good file: {outcome.error}"
        assert code == 0 and out["ok"], out
        assert out["config"]["values"] == outcome.config, "check printed another config than the run uses"
        assert [r["modules"] for r in out["plan"]["buckets"]] == outcome.plan
    else:
        assert code == 2 and not out["ok"], f"check approved a file the runtime refuses: {outcome.error}"
        assert case.error in out["error"], out["error"]
        assert outcome.error is not None, f"the runtime accepts a file check refuses: {out['error']}"
        assert _leaf(case.error) in outcome.error, outcome.error


def test_corpus_is_broad():
    """At least 20 bad files, over every shape, and good files of every shape."""
    bad = [c for c in CASES if c.error]
    assert len(bad) >= 20
    assert {c.shape for c in bad} == {c.shape for c in CASES if not c.error} == set(RUNTIME)


# ------------------------------------------------------------------ files that are not YAML
def _unreadable(tmp_path: Path) -> dict[str, bytes]:
    big = b"bucket_plans: auto\n" + b"# padding\n" * (MAX_CONFIG_BYTES // 10 + 1)
    assert len(big) > MAX_CONFIG_BYTES
    return {
        "empty.yaml": b"",
        "comments_only.yaml": b"# nothing set\n",
        "list.yaml": b"- bucket_plans: auto\n",
        "not_utf8.yaml": b"bucket_plans: auto\n# caf\xe9\n",
        "too_large.yaml": big * 5,  # 5 MiB
    }


@pytest.mark.parametrize("shape", ["plugin", "accelerate"])
def test_unreadable_files_get_one_verdict(tmp_path, monkeypatch, shape):
    """Empty, a list at the top, not UTF-8, 5 MiB: both readers stop at the file, naming it."""
    monkeypatch.chdir(ROOT)
    for name, content in _unreadable(tmp_path).items():
        path = tmp_path / name
        path.write_bytes(content)
        case = Case(path, shape, str(path), 2)
        code, out = check(case, MODEL, [])
        outcome = runtime(case)
        assert code == 2 and str(path) in out["error"], (name, out)
        assert outcome.error is not None and str(path) in outcome.error, (name, outcome.error)
