"""``lmsrt build``: compile the swap engine's C++ copy path for the installed torch."""
from __future__ import annotations

import time

import click

__all__ = ["command"]


@click.command("build")
@click.option("--verbose", is_flag=True, help="Show the compiler's output.")
def command(verbose: bool) -> None:
    """Compile csrc/copy_path.cpp against the installed torch (14-16 s on an H200 host, 18 s on
    a CPU host; once per torch version). LMS then makes its per-tensor CUDA calls from C++:
    the same calls with ~30% less CPU per swapped tensor. Needs a C++ compiler and ninja (pip
    install ninja).

    On a CUDA GPU the first LMS (or `lmsrt info`) builds it by itself; this builds it ahead of
    time (in a container image, on a shared LMSRT_CACHE), and retries a build that failed.
    The cache must be yours and not writable by group or others (chmod go-w); else the build
    goes to a private folder under the temporary folder, and `lmsrt info` says why.

    \b
    Examples:
      lmsrt build
      LMSRT_CACHE=/shared/lmsrt lmsrt build     # build where every node can see it
    """
    from .. import copy_path

    start = time.time()
    try:
        click.echo(f"lmsrt build: compiling {copy_path.source_path()} into "
                   f"{copy_path.build_dir()} ...")
        path = copy_path.build(verbose=verbose)
    except Exception as e:     # compiler, ninja or source missing: say which, and what to do
        raise click.ClickException(
            f"{type(e).__name__}: {e}\nThe C++ copy path is optional: lmsrt works without it, "
            "with more CPU per swapped tensor. To build it, install a C++ compiler and ninja "
            "(pip install ninja) and run `lmsrt build --verbose`.") from e
    click.echo(f"built {path} in {time.time() - start:.0f} s; copy path: {copy_path.status()}")
