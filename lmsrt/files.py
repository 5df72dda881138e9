"""Files written whole: to a fresh temporary file beside the path, then renamed over it.

Shared by the CLI's output files (launch/output.py, NOTE [ Output files ]) and lmsrt's cache
(cache.py, NOTE [ Trusting the cache ]): the temporary name is random and made with O_EXCL (a
link planted there is never followed), the path is checked again just before the rename (a link
or a device put there meanwhile is refused, not replaced), and a failure or a Ctrl-C midway leaves
the old file as it was.

Example::

    write_atomic("stats.json", lambda f: json.dump(data, f))
    write_atomic(record_path, lambda f: f.write(text), mode=0o600)
"""
from __future__ import annotations

import os
import secrets
import stat
from typing import IO, Callable, Optional

__all__ = ["kind_of", "write_atomic"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def kind_of(path: str) -> Optional[str]:
    """What is at ``path`` when it is not a regular file (None: a regular file, or nothing)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def write_atomic(path: str, write: Callable[[IO], None], *, binary: bool = False,
                 newline: Optional[str] = None, mode: Optional[int] = None) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, then rename it over ``path``.

    Raises OSError, ``path`` untouched, when writing fails or when ``path`` is no longer a
    regular file or absent. Keeps an existing file's permissions, or sets ``mode``.
    """
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    f = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666),  # umask applies
                  "wb" if binary else "w",
                  **({} if binary else {"encoding": "utf-8", "newline": newline}))
    try:
        with f:
            try:
                os.fchmod(f.fileno(), mode if mode is not None
                          else stat.S_IMODE(os.lstat(path).st_mode))
            except FileNotFoundError:
                pass
            write(f)
            f.flush()
            os.fsync(f.fileno())
        kind = kind_of(path)
        if kind is not None:
            raise OSError(f"{path} is {kind} now, not a regular file; lmsrt left it as it is")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
