"""The ``lmsrt`` command. One module per subcommand, each exposing a click ``command``.

Subcommands load when they run (``_LazyGroup``): ``lmsrt --version`` and ``lmsrt --help`` import
neither torch nor the engine, and answer in a fraction of a second.
"""
from __future__ import annotations

import importlib
from typing import List, Optional

import click

from .. import __version__

__all__ = ["main", "COMMANDS"]

# name -> (module, the line ``lmsrt --help`` shows); tests/test_docs.py checks each line against
# the command's own help.
COMMANDS = {
    "build": ("build", "Compile the C++ copy path against the installed torch, now."),
    "info": ("info", "Show versions, GPUs, host memory, pinned budget and native parts."),
    "profile": ("profile", "Run one training step of SCRIPT and report where its memory goes."),
    "run": ("run", "Run SCRIPT with LMS enabled from its first line to its last."),
    "steps": ("steps", "Show each step of a run from its --stats file, or plot them."),
    "tune": ("tune", "Find the LMS settings that train SCRIPT fastest."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: Optional[click.Context]) -> List[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: Optional[click.Context], name: str) -> Optional[click.Command]:
        if name not in COMMANDS:
            return None
        if name not in self.commands:
            module = importlib.import_module(f".{COMMANDS[name][0]}", __name__)
            self.commands[name] = module.command
        return self.commands[name]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name][1]) for name in self.list_commands(ctx)])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lmsrt")
def main() -> None:
    """lmsrt: large model support for PyTorch (swap saved activations to host memory)."""
