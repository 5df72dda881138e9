"""Run a user's script in this process as ``python script.py`` would, and say how it ended.

``lmsrt run`` and ``lmsrt profile`` both run unmodified scripts through ``run_script``: the same
``sys.argv``, ``sys.path[0]`` and ``__name__`` as under python, the same exit status, and on an
exception the traceback python would print, without the frames of lmsrt and runpy above the
script. What each command does around the script (LMS on, a recorder) is its own.

Example::

    end = run_script("train.py", ["--epochs", "1"])
    raise SystemExit(end.status)
"""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
import zipfile
from typing import ContextManager, NamedTuple, Optional, Sequence, Tuple, Type

__all__ = ["ScriptEnd", "check_script", "exit_status", "print_script_traceback", "run_script"]

# Frames of these modules above the script's own are left out of its traceback.
_OWN_FRAMES = ("lmsrt._cli.", __name__, "runpy")


class ScriptEnd(NamedTuple):
    """How a script ended: the status python would exit with, and the exception that ended it
    (``SystemExit`` included; None when it returned)."""

    status: int
    exception: Optional[BaseException] = None


def check_script(target: str, example: str) -> None:
    """Raise ValueError, saying what to give instead, unless python could run ``target``: a
    file, or a directory or zip file holding ``__main__.py`` (as ``python target`` runs it).
    ``example`` is a command line that ends the message."""
    if os.path.isdir(target):
        if os.path.isfile(os.path.join(target, "__main__.py")):
            return
        raise ValueError(f"{target!r} is a directory without a __main__.py, so python cannot "
                         f"run it; give a Python file or such a directory, e.g. {example}")
    if os.path.isfile(target):
        if zipfile.is_zipfile(target):
            with zipfile.ZipFile(target) as archive:
                if "__main__.py" not in archive.namelist():
                    raise ValueError(f"{target!r} is a zip file without a __main__.py, so python "
                                     f"cannot run it; give a Python file, e.g. {example}")
        return
    raise ValueError(f"script {target!r} does not exist; give the path of a Python file (or of "
                     f"a directory or zip file with a __main__.py), e.g. {example}")


def exit_status(code: object) -> int:
    """The status python exits with for ``sys.exit(code)``, printing a message code to stderr as
    python does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stdout.flush()
    print(code, file=sys.stderr, flush=True)
    return 1


def print_script_traceback(e: BaseException) -> None:
    """The traceback python would print: without the frames of lmsrt's runner and CLI and of
    runpy (frozen or not) above the script."""
    tb = e.__traceback__
    while tb is not None and (tb.tb_frame.f_globals.get("__name__") or "").startswith(_OWN_FRAMES):
        tb = tb.tb_next
    sys.stdout.flush()
    traceback.print_exception(type(e), e, tb, file=sys.stderr)


def run_script(target: str, args: Sequence[str], *, as_module: bool = False,
               around: Optional[ContextManager] = None,
               finished: Tuple[Type[BaseException], ...] = (),
               quiet: Tuple[Type[BaseException], ...] = ()) -> ScriptEnd:
    """Run the script ``target`` (a file, or a directory or zip file with a ``__main__.py``; a
    module with ``as_module``, as ``python -m``) with ``args``, inside the context manager
    ``around`` if given; return how it ended.

    Status as under python: 0 when it returns, ``sys.exit``'s status (a message printed), 130
    after Ctrl-C, else 1 with the script's traceback printed. Exceptions in ``finished`` end it
    with status 0 (a caller's own stop signal); those in ``quiet`` with status 1 and no traceback
    (the caller reports them). ``sys.argv`` and ``sys.path`` are restored afterwards.
    """
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        # sys.argv and sys.path[0] as `python script.py` / `python -m module` would set them;
        # run_module replaces argv[0] with the module's file.
        sys.argv = [target, *args]
        with around if around is not None else contextlib.nullcontext():
            if as_module:
                sys.path[0:1] = [os.getcwd()]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                # __file__ absolute, as python makes it. A directory or zip file with a
                # __main__.py goes first on sys.path itself, in place of the script's directory
                # (run_path puts it there).
                path = os.path.abspath(target)
                sys.path[0:1] = [] if os.path.isdir(path) or zipfile.is_zipfile(path) else [
                    os.path.dirname(path)]
                runpy.run_path(path, run_name="__main__")
    except finished as e:
        return ScriptEnd(0, e)
    except SystemExit as e:
        return ScriptEnd(exit_status(e.code), e)
    except quiet as e:
        return ScriptEnd(1, e)
    except KeyboardInterrupt as e:
        print_script_traceback(e)
        return ScriptEnd(130, e)
    except BaseException as e:  # noqa: BLE001 - the script's end, whatever it was, is reported
        print_script_traceback(e)
        return ScriptEnd(1, e)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return ScriptEnd(0)
