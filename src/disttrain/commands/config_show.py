"""``disttrain config show``: the configuration a ``disttrain train`` with the same
arguments would run, resolved and validated, printed as TOML; nothing is trained."""

from __future__ import annotations

import argparse
import sys

from ..errors import UserError


def add_config_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    config = sub.add_parser(
        "config", help="show the resolved configuration without training",
        description="Inspect a configuration without training.")
    commands = config.add_subparsers(dest="config_command", required=True,
                                     metavar="{show}", parser_class=type(config))
    show = commands.add_parser(
        "show", help="print the fully resolved configuration as TOML",
        description="Load CONFIG (or the defaults), apply every --set, validate the whole "
        "configuration for N ranks as 'disttrain train' does, and print it as TOML: every "
        "key with its value, the batch triple as the two members the third is derived "
        "from, and the resolved layout and batch in a comment. The output loads back "
        "with 'disttrain train FILE'.")
    show.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                      help="TOML file with [section] tables (default: the defaults)")
    show.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      dest="overrides", help="override one config value (repeatable)")
    show.add_argument("--nproc", type=int, default=2, metavar="N",
                      help="ranks to resolve the layout and batch for (default 2)")
    return config


def run_config(ns: argparse.Namespace) -> int:
    from ..config.dump import config_to_toml
    from ..config.load import load_config
    from ..run_checks import resolve

    if ns.nproc < 1:
        raise UserError(f"--nproc {ns.nproc}: must be at least 1")
    config = load_config(ns.config, ns.overrides)
    sys.stdout.write(config_to_toml(config, resolve(config, ns.nproc)))
    return 0
