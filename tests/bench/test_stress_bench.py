"""benchmarks/stress.py: how it tells the ends of a run apart, and a real short run."""

from __future__ import annotations

import json
import os
import stat

import _bench
import pytest

stress = _bench.load("stress")


def test_help_and_list():
    text = _bench.help_text("stress")
    for option in ("--malloc-check", "--perturb", "--valgrind", "--cores", "--variants"):
        assert option in text


def test_list_names_every_variant(capsys):
    assert stress.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("default", "native_rs", "no_bucketing", "passes_off", "no_compile", "aot_eager", "lightning"):
        assert out.count(f"{name} ") >= 1, out


@pytest.mark.parametrize(
    ("codes", "hung", "loss", "memcheck", "end"),
    [
        ([0, 0], False, "4.5", [], "ok"),
        ([-6, 0], False, None, [], "native"),
        ([0, -11], False, "4.5", [], "native"),  # died at exit, after printing its loss
        ([0, 0], False, "4.5", ["Invalid write of size 4"], "native"),
        ([1, -15], False, None, [], "failed"),  # SIGTERM is not a death in native code
        ([0, -9], False, "4.5", [], "failed"),  # nor SIGKILL (the OOM killer)
        ([1, 0], False, None, [], "failed"),
        ([0, 0], False, None, [], "failed"),  # no final loss printed
        ([-9, -9], True, None, [], "hang"),
    ],
)
def test_classify(codes, hung, loss, memcheck, end):
    assert stress.classify(codes, hung, loss, memcheck) == end


def test_variants_parse_and_unknown_names_say_the_valid_ones():
    assert stress._parse_variants("default:3,lightning", 20) == [("default", 3), ("lightning", 20)]
    with pytest.raises(SystemExit, match="unknown variant 'defualt'; valid: default, native_rs"):
        stress._parse_variants("defualt:3", 20)


def test_malloc_env():
    env = stress._malloc_env(check=True, perturb=165)
    assert os.path.exists(env["LD_PRELOAD"]) and "libc_malloc_debug" in env["LD_PRELOAD"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.check=3:glibc.malloc.perturb=165"
    assert stress._malloc_env(check=False, perturb=None) == {}


def test_memcheck_errors_skip_the_loader_and_keep_real_ones(tmp_path):
    log = tmp_path / "valgrind0.txt"
    log.write_text(
        "==7== Invalid read of size 8\n"
        "==7==    at 0x4023C6C: strncmp (strcmp-sse2.S:160)\n"
        "==7==    by 0x4004BEE: is_dst (dl-load.c:216)\n"
        "==7==    by 0x40059BE: _dl_dst_count (dl-load.c:253)\n"
        "==7== \n"
        "==7== Use of uninitialised value of size 8\n"
        "==7==    at 0x49E0569: Py_INCREF (object.h:502)\n"
        "==7== \n"
        "==7== Invalid write of size 4\n"
        "==7==    at 0x1234: gloo::transport::tcp::Pair::read() (in libtorch_cpu.so)\n"
        "==7==    by 0x5678: gloo::transport::tcp::Loop::run() (in libtorch_cpu.so)\n"
        "==7==  Address 0x99 is 0 bytes inside a block of size 64 free'd\n"
    )
    errors = stress._memcheck_errors(log)
    assert len(errors) == 1 and errors[0].startswith("==7== Invalid write of size 4"), errors
    assert stress._memcheck_errors(tmp_path / "absent.txt") == []


def test_a_rank_killed_by_a_signal_is_a_native_death_and_its_directory_kept(tmp_path, monkeypatch):
    """The real ``run_once``, with a "python" that kills itself with SIGSEGV."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -SEGV $$\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(stress.sys, "executable", str(fake))
    result = stress.run_once("default", 1, tmp_path / "run", {}, timeout=60, valgrind=False, cores=False)
    assert result["end"] == "native" and result["codes"] == [-11, -11], result
    assert (tmp_path / "run" / "rank0.txt").exists()


@pytest.mark.slow
def test_a_real_run_trains_and_gives_one_loss(tmp_path):
    """Two fresh 2-rank aot_eager trainings of the tied Llama: both end ok with the same
    final loss (the determinism the runner's "losses" column relies on)."""
    out = tmp_path / "json"
    code = stress.main(
        ["--variants", "aot_eager:2", "--steps", "2", "--out", str(tmp_path / "runs"), "--json", str(out)]
    )
    rows = json.loads(out.read_text())["results"]["aot_eager"]
    assert code == 0, rows
    assert [r["end"] for r in rows] == ["ok", "ok"]
    assert rows[0]["loss"] == rows[1]["loss"] and float(rows[0]["loss"]) > 0
    assert not list((tmp_path / "runs").iterdir())  # ok runs are not kept
