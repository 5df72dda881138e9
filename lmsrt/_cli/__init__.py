"""The ``lmsrt`` command. One module per subcommand, each exposing a click ``command``."""
from __future__ import annotations

import click

from .. import __version__
from . import build, info, profile, run, tune

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lmsrt")
def main() -> None:
    """lmsrt: large model support for PyTorch (swap saved activations to host memory)."""


for _module in (run, tune, info, profile, build):
    main.add_command(_module.command)
