"""Run a training command in this process, as the shell would run it: ``lmsrt run ...`` as
``python -m lmsrt run ...``, else ``script.py args`` as ``python script.py args``. For the
measuring tools beside it (host_sampler.py, alloc_trace.py), which must share the process."""
from __future__ import annotations

import os
import runpy
import sys
from typing import List


def split_command(tool: str, argv: List[str]) -> tuple:
    """(the tool's own arguments, the command after ``--``); exits with a message where there
    is no command."""
    if "--" not in argv:
        sys.exit(f"{tool}: give the command after --, e.g. -- lmsrt run train.py")
    cut = argv.index("--")
    command = argv[cut + 1:]
    if not command:
        sys.exit(f"{tool}: the command after -- is empty")
    return argv[:cut], command


def run_command(command: List[str]) -> None:
    sys.argv = list(command)
    if command[0] == "lmsrt":
        runpy.run_module("lmsrt", run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
        runpy.run_path(command[0], run_name="__main__")
