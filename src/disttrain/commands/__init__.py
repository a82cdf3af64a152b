"""Subcommands of ``disttrain`` that only inspect: ``config show`` and ``env``. Each
module adds its parser and runs it; nothing here trains or starts a process group."""
