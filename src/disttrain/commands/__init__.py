"""The subcommands of ``disttrain``, one module each: ``train``, ``export``, ``run``,
``report``, ``plan`` (and ``plan calibrate``), ``slurm``, ``config show``, ``env``.

Each module adds its parser (``add_<name>_parser``: the arguments and the help text)
and runs a parsed namespace, returning the exit code; the work itself stays in the
packages it belongs to (train/, launch/, plan/, monitor/report, checkpoint/export).
:mod:`disttrain.cli` assembles the parsers in order and dispatches.
"""
