"""Values that used to crash only inside the workers (or exhaust the host) are refused by
``disttrain train`` before launch: one line on stderr, exit 2, the launcher never called.

Run in-process (``disttrain.cli.main``) with the launcher replaced by a failing stub."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import disttrain.launch.agent
import disttrain.plan.capacity as capacity
from disttrain.cli import main
from disttrain.config import load_config
from disttrain.errors import ConfigError, DataError
from disttrain.plan.capacity import RankMemory, check_batch_fits, check_model_fits, rank_memory
from disttrain.run_checks import resolve

GIB = 2**30
SEQ = 16


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """The launcher fails the test if reached; returns the calls of a permitted one."""
    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(disttrain.launch.agent, "launch",
                        lambda *a, **k: pytest.fail(f"launcher reached with {a}"))


def refused(capsys, args: list[str], named: str) -> str:
    assert main(["train", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("disttrain: error: "), lines
    assert named in lines[0], lines[0]
    return lines[0]


def text_dir(tmp_path, name: str, sizes: tuple[int, ...]):
    """A data directory of text files of the given sizes in bytes."""
    root = tmp_path / name
    root.mkdir()
    for i, size in enumerate(sizes):
        (root / f"f{i}.txt").write_text("x" * size)
    return root


BIG = 10**12
SETTINGS = [
    ("parallel.timeout_s=inf", "parallel.timeout_s"),
    ("parallel.bucket_mb=inf", "parallel.bucket_mb"),
    (f"model.vocab_size={BIG}", "model.vocab_size"),
    (f"model.seq_len={BIG}", "model.seq_len"),
    (f"model.d_model={BIG}", "model.d_model"),
    ("model.vocab_size=100", "model.vocab_size"),
    (f"train.global_batch={BIG}", "train.global_batch"),
    (f"model.n_layer={10**20}", "model.n_layer"),
]


@pytest.mark.parametrize("setting,named", SETTINGS, ids=[s for s, _ in SETTINGS])
def test_values_beyond_the_machine_are_refused_before_launch(setting, named, no_launch,
                                                              capsys):
    line = refused(capsys, ["--set", setting], named)
    assert "Traceback" not in line


@pytest.mark.parametrize("setting", [f"model.{f}={BIG}" for f in ("vocab_size", "seq_len",
                                                                   "d_model")]
                         + [f"model.n_layer={10**20}", f"train.global_batch={BIG}"])
def test_a_memory_refusal_gives_the_estimate_and_what_the_host_has(setting, no_launch,
                                                                   capsys):
    line = refused(capsys, ["--set", setting], setting.partition("=")[0])
    assert "GiB per rank" in line and "available for 2 local rank(s)" in line


def test_a_config_file_that_is_not_utf8_is_one_line(no_launch, capsys, tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[train]\nsteps = 5  # r\u00e9glage\n".encode("latin-1"))
    line = refused(capsys, [str(path)], "latin1.toml")
    assert "UTF-8" in line


def test_data_shorter_than_one_sample_is_refused_naming_the_directory(no_launch, capsys,
                                                                       tmp_path):
    short = text_dir(tmp_path, "short", (SEQ - 1, SEQ - 1))  # + separator: SEQ tokens
    line = refused(capsys, ["--set", f"data.path={short}", "--set", f"model.seq_len={SEQ}"],
                   str(short))
    assert f"model.seq_len+1={SEQ + 1}" in line and f"model.seq_len to {SEQ - 1}" in line


def test_data_of_exactly_one_sample_per_split_is_accepted(no_launch, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(disttrain.launch.agent, "launch", lambda *a: calls.append(a) or 0)
    exact = text_dir(tmp_path, "exact", (SEQ, SEQ))  # + separator: SEQ + 1 tokens each
    assert main(["train", "--set", f"data.path={exact}", "--set", f"model.seq_len={SEQ}",
                 "--set", "model.n_layer=1", "--set", "model.d_model=32"]) == 0
    assert len(calls) == 1


def test_a_job_started_by_torchrun_makes_the_data_checks_too(monkeypatch, tmp_path):
    from disttrain.train import build_default_job

    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="model.vocab_size=100"):
        build_default_job(load_config(overrides=["model.vocab_size=100"]))
    short = text_dir(tmp_path, "short", (SEQ - 1, SEQ - 1))
    with pytest.raises(DataError, match="fewer than one sample"):
        build_default_job(load_config(overrides=[f"data.path={short}",
                                                 f"model.seq_len={SEQ}"]))


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("stdlib-cache")


@pytest.mark.parametrize("nproc", ["2", "4"])
def test_the_default_job_is_not_refused(nproc, no_launch, monkeypatch, stdlib_cache):
    monkeypatch.setenv("DISTTRAIN_CACHE", str(stdlib_cache))
    calls = []
    monkeypatch.setattr(disttrain.launch.agent, "launch", lambda *a: calls.append(a) or 0)
    assert main(["train", "--nproc", nproc]) == 0
    assert len(calls) == 1 and calls[0][0].nproc == int(nproc)


def test_the_estimate_follows_the_layout():
    """Model states of 8 x 1024^2 x 12 ~ 100M parameters: 1.5 GiB on one rank, a quarter of
    that with ZeRO-3 over four."""
    config = load_config(overrides=["model.n_layer=8", "model.d_model=1024",
                                    "model.n_head=8", "train.global_batch=4"])
    with pytest.raises(ConfigError, match=r"model.d_model=1024: needs ~1.5 GiB per rank"):
        check_model_fits(config, 1, 1, RankMemory(bytes=GIB, source="test"))
    zero3 = load_config(overrides=["model.n_layer=8", "model.d_model=1024",
                                   "model.n_head=8", "train.global_batch=4",
                                   "parallel.zero=3"])
    check_model_fits(zero3, 4, 4, RankMemory(bytes=GIB, source="test"))


def test_activations_are_counted_after_states():
    config = load_config(overrides=["train.global_batch=4096"])
    plan = resolve(config, 1)
    check_model_fits(config, 1, 1, RankMemory(bytes=GIB, source="test"))
    check_batch_fits(config, plan, 1, RankMemory(bytes=64 * GIB, source="test"))
    with pytest.raises(ConfigError, match=r"train.global_batch=4096: needs ~.* micro-batch"):
        check_batch_fits(config, plan, 1, RankMemory(bytes=GIB, source="test"))


def test_cpu_ranks_share_the_hosts_available_memory(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n")
    monkeypatch.setattr(capacity, "_MEMINFO", meminfo)
    memory = rank_memory(load_config(overrides=["train.device=cpu"]), 4)
    assert memory.bytes == 4 * GIB and "16.0 GiB available for 4" in memory.source


def test_gpu_ranks_get_one_device_each(monkeypatch):
    monkeypatch.setattr(capacity, "on_gpu", lambda train: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=80 * GIB))
    config = load_config()
    assert rank_memory(config, 2).bytes == 80 * GIB
    assert rank_memory(config, 4).bytes == 40 * GIB  # two ranks per device


def test_a_transformers_model_is_estimated_from_its_own_config(no_launch, capsys,
                                                              tmp_path):
    """A Llama config.json of ~70B parameters: refused from its own dimensions (the
    [model] defaults are tiny); a small one passes the same check."""
    import json

    def llama(path, layers, hidden, ffn):
        path.write_text(json.dumps({
            "model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
            "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": ffn,
            "vocab_size": 32000, "max_position_embeddings": 4096}))
        return path
    big = llama(tmp_path / "big.json", 80, 8192, 28672)
    line = refused(capsys, ["--set", f"model.hf_config={big}"], "model.hf_config")
    assert "GiB per rank for model states" in line
    config = load_config(overrides=[f"model.hf_config={big}"])
    with pytest.raises(ConfigError, match=r"needs ~1,0\d\d.\d GiB per rank"):  # 69e9 x 16 B
        check_model_fits(config, 1, 1, RankMemory(bytes=GIB, source="test"))
    small = llama(tmp_path / "small.json", 2, 256, 512)
    check_model_fits(load_config(overrides=[f"model.hf_config={small}"]), 1, 1,
                     RankMemory(bytes=GIB, source="test"))


def test_two_bad_values_in_one_command_are_both_reported(no_launch, capsys):
    assert main(["train", "--set", "train.steps=0", "--set", "comm.codec=zip"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("disttrain: error: ") for line in lines), lines
    assert "train.steps=0" in lines[0] and "comm.codec='zip'" in lines[1]
