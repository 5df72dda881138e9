"""The files the CLI writes (``--stats``, ``--out``, ``--html``...): checked before, written whole.

NOTE [ Output files ]
A run can take hours, so a path it cannot write fails before it starts, not at its end. What is
at that path is the user's and must survive:

* Only regular files are written. A symlink is refused, not followed (its target may be anything;
  give the target's own path), and so are devices, FIFOs and sockets: ``os.replace`` onto
  ``/dev/full``, run as root, turned the device node into a JSON file.
* A file is written to a temporary file beside it, then renamed over it in one step: a failure or
  a Ctrl-C midway leaves the old file as it was, and a reader never sees half a file. Just before
  the rename the path is checked again, in case something else was put there during the run.

Example::

    path = check_output_file("stats.json")             # ValueError saying why not, what to do
    ...                                                 # the run
    write_atomic(path, lambda f: json.dump(data, f))   # OSError, the old file kept
"""
from __future__ import annotations

import os
import tempfile

from ..files import kind_of as _kind
from ..files import write_atomic

__all__ = ["check_output_dir", "check_output_file", "write_atomic"]

def check_output_dir(path: str) -> str:
    """Make sure files can be written in directory ``path`` (created if missing); return it
    absolute. ValueError saying why not and what to give instead."""
    where = os.path.abspath(path)
    _check_dir(where, "", "give a directory, or a path where one can be created")
    return where


def _check_dir(where: str, said: str, instead: str) -> None:
    existing = where
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{said}{existing} is {_kind(existing) or 'a file'}, not a directory; "
                         f"{instead}")
    try:
        os.makedirs(where, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=where, prefix=".lmsrt-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{said}cannot write in {where} ({e.strerror or e}); give a path in a "
                         "directory you can write") from None


def check_output_file(path: str, instead: str = "") -> str:
    """Make sure a run can write the file ``path``: absent or a regular file, in a directory it
    can write (created if missing); return it absolute. ValueError if not, saying why and what
    to do: ``instead`` when there is something else at ``path``, if given."""
    where = os.path.abspath(path)
    kind = _kind(where)
    if kind == "a symlink":
        raise ValueError(f"{path} is a symlink; lmsrt does not write through links, so that "
                         "nothing they point to is replaced. " + (
                             instead or f"Give the file's own path (readlink -f {path})"))
    if kind is not None:
        raise ValueError(f"{path} is {kind}, not a regular file; lmsrt writes only regular files, "
                         "replacing them whole. " + (
                             instead or "Give the path of a regular file, or of a new one"))
    if os.path.exists(where) and not os.access(where, os.W_OK):
        raise ValueError(f"{path} is read-only. " + (
            instead or f"Make it writable (chmod u+w {path}), or give another path"))
    _check_dir(os.path.dirname(where), f"{path}: ",
               "give a path under a directory (missing ones are created)")
    return where
