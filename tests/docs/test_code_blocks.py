"""Every fenced block of README.md and docs/ is marked (see ``doc_blocks``), and the
marked ones are checked: ``test: run`` blocks run in one shared directory, in page order
(``disttrain train`` with a fifth of its steps), ``test: validate`` configurations pass
``disttrain config show``, ``test: transcript`` commands print what the page shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import ROOT, all_blocks, commands, marked

import disttrain.launch.agent
from disttrain import cli

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

STEPS_DIVISOR = 5  # a `disttrain train` in a run block trains train.steps / 5 steps
DEFAULT_STEPS = 4  # or this many, where it sets none
RUN_TIMEOUT_S = 180


def test_every_block_is_marked():
    problems = [f"{b.id}: no marker on the line before the fence" for b in all_blocks()
                if b.marker is None]
    for b in all_blocks():
        if b.marker and b.marker.startswith("test: ") and b.marker not in (
                "test: run", "test: validate", "test: transcript"):
            problems += [f"{b.id}: {path} does not exist" for path in b.marker[6:].split()
                         if not (ROOT / path).is_file()]
    assert not problems, "\n".join(problems)


def test_the_runnable_blocks_are_cheap_and_present():
    runs = marked("test: run")
    assert len(runs) >= 8 and len(marked("test: validate")) >= 10
    assert all(b.lang in ("bash", "python", "toml") for b in runs)


# ---------------------------------------------------------------- validate, transcript
def _config_show_argv(argv: list[str]) -> list[str]:
    """``disttrain config show`` with the CONFIG, --set and --nproc of a train command
    (a ``torchrun --nproc-per-node N -m disttrain train`` line gives its N)."""
    at = argv.index("disttrain")
    assert argv[at + 1] == "train", argv
    ns = cli.build_parser().parse_args(argv[at + 1:])
    nproc = ns.nproc
    if "--nproc-per-node" in argv[:at]:
        nproc = int(argv[argv.index("--nproc-per-node") + 1])
    out = ["config", "show", "--nproc", str(nproc)]
    out += [ns.config] if ns.config else []
    for item in ns.overrides:
        out += ["--set", item]
    return out


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a documented command went past validation to the launcher")

    monkeypatch.setattr(disttrain.launch.agent, "launch", refuse)


def _main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize("block", marked("test: validate"), ids=lambda b: b.id)
def test_validate_block(block, no_launch, capsys):
    lines = [argv for argv in commands(block.code) if "disttrain" in argv]
    assert lines, f"{block.id}: no disttrain train command"
    for argv in lines:
        show = _config_show_argv(argv)
        code = _main(show)
        out = capsys.readouterr()
        assert code == 0, f"{' '.join(argv)}\n-> disttrain {' '.join(show)}: {out.err}"
        assert "[train]" in out.out


@pytest.mark.parametrize("block", marked("test: transcript"), ids=lambda b: b.id)
def test_transcript_block(block, no_launch, capsys):
    parts = re.split(r"^\$ (.*)$", block.code, flags=re.M)[1:]
    assert parts, f"{block.id}: no '$ command' line"
    for command, expected in zip(parts[::2], parts[1::2], strict=True):
        argv = commands(command)[0]
        assert argv[0] == "disttrain"
        code = _main(argv[1:])
        out = capsys.readouterr()
        printed = (out.out + out.err).splitlines()
        for line in expected.strip().splitlines():
            assert line in printed, f"{command}: {line!r} not in {printed}"
        assert code == 2, command


# ---------------------------------------------------------------------------- run
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One directory for every run block (later blocks use earlier blocks' runs), a
    ``disttrain`` on PATH that runs this checkout, and a token cache of its own."""
    work = tmp_path_factory.mktemp("doc-blocks")
    bin_dir = work / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "disttrain"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m disttrain "$@"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
               f"{env.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
               DISTTRAIN_CACHE=str(work / ".cache"))
    return work, env


def _shortened(line: str) -> str:
    """A ``disttrain train`` line with ``train.steps`` divided by ``STEPS_DIVISOR`` (so
    a later command that continues a run still adds steps), or a few steps if unset."""
    command, hash_, comment = line.partition(" #")
    if "train.steps=" in command:
        command = re.sub(r"train\.steps=(\d+)",
                         lambda m: f"train.steps={max(1, int(m[1]) // STEPS_DIVISOR)}",
                         command)
    else:
        command = f"{command.rstrip()} --set train.steps={DEFAULT_STEPS}"
    return command + hash_ + comment


def _run_shell_line(line: str, work: Path, env: dict, monkeypatch, capsys) -> None:
    """``disttrain train`` / ``run`` as processes (they launch workers); other
    ``disttrain`` subcommands in this process (``> FILE`` honoured); anything else
    through bash."""
    argv = commands(line)[0] if commands(line) else []
    if argv[:1] == ["disttrain"] and argv[1] not in ("train", "run"):
        out_file = None
        if ">" in argv:
            at = argv.index(">")
            argv, out_file = argv[:at], argv[at + 1]
        with monkeypatch.context() as m:
            m.chdir(work)
            m.setenv("DISTTRAIN_CACHE", env["DISTTRAIN_CACHE"])
            code = _main(argv[1:])
        out = capsys.readouterr()
        assert code == 0, f"{line}\n{out.out[-2000:]}\n{out.err[-2000:]}"
        if out_file:
            (work / out_file).write_text(out.out)
        return
    if argv[:2] == ["disttrain", "train"]:
        line = _shortened(line)
    done = subprocess.run(["bash", "-e", "-c", line], cwd=work, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


def _unique(blocks):
    seen, out = set(), []
    for b in blocks:
        if (b.lang, b.code) not in seen:
            seen.add((b.lang, b.code))
            out.append(b)
    return out


@pytest.mark.parametrize("block", _unique(marked("test: run")), ids=lambda b: b.id)
def test_run_block(block, workdir, monkeypatch, capsys):
    work, env = workdir
    if block.lang == "bash":
        for line in re.sub(r"\\\n\s*", " ", block.code).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                _run_shell_line(line, work, env, monkeypatch, capsys)
    elif block.lang == "toml":
        config = work / "block.toml"
        config.write_text(block.code)
        _run_shell_line(f"disttrain config show {config}", work, env, monkeypatch, capsys)
    else:
        script = work / f"block_{block.line}.py"
        script.write_text(block.code)
        done = subprocess.run([sys.executable, str(script)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        assert done.returncode == 0, f"{block.id}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
