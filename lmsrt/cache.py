"""What lmsrt keeps between runs, under ``$LMSRT_CACHE`` (default ``$XDG_CACHE_HOME/lmsrt``, else
``~/.cache/lmsrt``): the built C++ copy path (copy_path.py) and, per run, the pinned host memory
it used. See NOTE [ Trusting the cache ] for what lmsrt reads and loads from there.

NOTE [ Pinning ahead ]
A first step that swaps waits for its pins (host.py, NOTE [ Pinning ]): measured on an H200,
0.4-0.8 s of a 1.4-1.9 s first step on the benchmark's models, where a settled step takes
0.17-0.41 s. A run of the same command as before needs what that run needed, so each LMS
remembers the pinned slabs its steps used (``PinMemo``) and, as the next run's LMS is created,
slabs of the same sizes start pinning in the background (``HostPool.pin_slabs``): under ``lmsrt
run`` while the script builds its model and its data, and in any case ahead of the first save.
Measured there (benchmarks/pinning.py, the rerun against the first run): waiting for pins in the
first step 0.78 -> 0.00 s (gpt), 0.46 -> 0.10 s (seg), 0.42 -> 0.00 s (lm).

  Which run. A record is per command line (``sys.orig_argv``, files by their real paths),
  working directory, host, local rank, GPU, memory limit and settings, and per LMS created in
  the process with all of those (a script's second LMS is not its first). Another command, cap
  or setting starts cold, as before; nothing else is guessed.
  What. The sizes of the slabs that requests used, at the step's end where they were the most
  (under ``lms_frac="auto"`` step 1, which swaps every eligible tensor): the same layout serves
  the same requests, where the bytes alone, pinned in chunks, left large tensors without a slab
  to fit (measured on the conv net: 15.2 GiB pinned for 8.9 GiB in use). Written when it first
  grows past the record by a sixteenth (at once after step 1, so a killed run still leaves it),
  and at ``close`` when the run used a sixteenth less than the record (slabs pinned ahead that
  no request used drop out of it).
  Never in the way. A record that cannot be read or written (no such file, a read-only cache,
  garbage: said in one line) is as no record; writes replace the file whole; the last ``_KEEP``
  records are kept.
  ``pin_ahead=False`` (``--pin-ahead off``, ``LMSRT_PIN_AHEAD=off``) neither reads nor writes.
  Pins ahead take no more than the host budget allows, and those no step uses are given back
  after ``_IDLE_STEPS`` steps like any slab.

NOTE [ Trusting the cache ]
What lies under the cache decides what lmsrt pins (records) and what code it runs (the built
copy path), and docs/native.md suggests a cache shared by every node: another user must not be
able to put either there, nor make lmsrt write through a link of theirs.
  1. A folder is trusted if it is owned by this user and not writable by group or others
     (``unsafe``), as ssh does with ~/.ssh; lmsrt makes its folders 0700. ``pins/`` and each
     build folder are lmsrt's own, so a link there is refused too (a cache folder that is itself
     a link, to a scratch disk say, is judged by what it points to).
  2. An untrusted records folder: no records are read or written, said once in one line. An
     untrusted build (its folder, or the built file itself): it is not loaded, said once, and
     the copy path builds in a private folder instead (copy_path.py, ``private_root``).
  3. Files are written by ``write_file`` (files.py): a fresh random temporary name made with
     O_EXCL in the same folder, mode 0600, then renamed over the target unless a link or a
     special file was put there meanwhile, so nothing planted at a guessable name is followed
     and a reader sees the old file or the new one.
  4. Records are read only from regular files (O_NOFOLLOW|O_NONBLOCK, then ``fstat``: a FIFO or
     a link to /dev/zero never blocks), at most ``_MAX_RECORD`` bytes, of the record's own
     form and no deeper (``_record_slabs``; json's parser stops deeper nesting at Python's
     recursion limit, RecursionError), with at most ``_MAX_SLABS`` slabs of at most
     ``_MAX_SLAB`` bytes each: checks linear in its size. Anything else is as no record, said
     in one line.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import json
import os
import socket
import stat
import sys
import time
from typing import List, Optional

from .files import write_atomic
from .say import say

__all__ = ["cache_root", "pins_dir", "unsafe", "trusted_dir", "write_file", "say_once", "PinMemo"]

_KEEP = 256                  # records kept in pins_dir(); the oldest go first
_MAX_RECORD = 1 << 20        # bytes of a record: a command line and _MAX_SLABS numbers fit
_MAX_SLABS = 4096            # slabs of a record: at least 32 MiB each (host.py), so 128 GiB up
_MAX_SLAB = 1 << 40          # bytes of one slab
_runs: collections.Counter = collections.Counter()   # LMS objects made per run key, this process
_said: set = set()           # lines said once (say_once)


def cache_root() -> str:
    """Where lmsrt keeps what outlives a run: ``$LMSRT_CACHE``, else ``$XDG_CACHE_HOME/lmsrt``
    (an absolute one, as the XDG spec asks), else ``~/.cache/lmsrt``.

    Example::

        cache_root()      # XDG_CACHE_HOME=/scratch/me/.cache: /scratch/me/.cache/lmsrt
    """
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("LMSRT_CACHE") or os.path.join(base, "lmsrt")


def pins_dir() -> str:
    """The records of pinned host memory, one file per run (NOTE [ Pinning ahead ])."""
    return os.path.join(cache_root(), "pins")


def say_once(text: str) -> None:
    """A note of the ``lmsrt`` logger (``lmsrt.say``), once per process.

    Example::

        say_once("lmsrt: pin records are off: ...")    # a second call says nothing
    """
    if text not in _said:
        _said.add(text)
        say(text)


def unsafe(path: str, link_ok: bool = True) -> str:
    """Why ``path`` cannot be trusted with what lmsrt reads or loads, or '' if it can: it must
    be owned by this user and not writable by group or others, and be no link unless
    ``link_ok`` (then what it points to is judged); NOTE [ Trusting the cache ], Rule 1.

    Example::

        unsafe("/shared/lmsrt")   # "/shared/lmsrt is writable by group or others (mode 775)"
    """
    try:
        st = os.stat(path) if link_ok else os.lstat(path)
    except OSError as e:
        return f"{path} cannot be examined ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o})")
    return ""


def trusted_dir(path: str) -> str:
    """Make lmsrt's own folder ``path`` (0700) if it is not there; why it cannot be trusted, or
    '' (NOTE [ Trusting the cache ], Rule 1: the folder holding it may be a link, it may not).

    Example::

        why = trusted_dir(pins_dir())    # '': read and write records there
    """
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)   # the cache, if new
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        return f"{path} cannot be made ({e.strerror})"
    return unsafe(os.path.dirname(path)) or unsafe(path, link_ok=False)


def write_file(path: str, text: str) -> None:
    """Replace ``path`` with ``text``, readable by the user alone, through a fresh temporary file
    beside it (NOTE [ Trusting the cache ], Rule 3; files.py); raises OSError.

    Example::

        write_file(os.path.join(pins_dir(), "x.json"), json.dumps(record))
    """
    write_atomic(path, lambda f: f.write(text), mode=0o600)


def _read_small(path: str, cap: int) -> Optional[bytes]:
    """The bytes of the regular file ``path`` (None if there is none); ValueError if it is no
    regular file or is over ``cap`` bytes. Never follows a link or blocks (Rule 4)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError("it is a symbolic link" if e.errno == errno.ELOOP else e.strerror)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("it is not a regular file")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"it is larger than {cap} bytes")
    return data


def _record_slabs(data: bytes) -> List[int]:
    """The slabs of a record's bytes; ValueError (or RecursionError) for anything but a record
    of PinMemo's form within the bounds of NOTE [ Trusting the cache ], Rule 4."""
    record = json.loads(data)
    if not isinstance(record, dict) or not set(record) <= {"slabs", "command", "written"}:
        raise ValueError("it is not a record of slabs")
    slabs, command = record.get("slabs"), record.get("command", [])
    if (not isinstance(slabs, list) or not isinstance(command, list)
            or not all(isinstance(arg, str) for arg in command)
            or not isinstance(record.get("written", ""), str)):
        raise ValueError("it is not a record of slabs")
    if len(slabs) > _MAX_SLABS:
        raise ValueError(f"it has {len(slabs)} slabs, more than {_MAX_SLABS}")
    if not all(type(n) is int and 0 < n <= _MAX_SLAB for n in slabs):
        raise ValueError(f"its slabs are not all whole numbers of bytes from 1 to {_MAX_SLAB}")
    return slabs


def _prune(folder: str) -> None:
    """Keep the ``_KEEP`` records written last (one per command run: they pile up)."""
    try:
        records = [os.path.join(folder, name) for name in os.listdir(folder)
                   if name.endswith(".json")]
        if len(records) > _KEEP:
            records.sort(key=os.path.getmtime)
            for path in records[:-_KEEP]:
                os.unlink(path)
    except OSError:              # another process pruned them first
        pass


def _command() -> list:
    """The command line of this process, as it started (under ``lmsrt run`` an LMS is made
    before the script's ``sys.argv`` is set), its files by their real paths."""
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    return [os.path.realpath(arg) if os.path.isfile(arg) else arg for arg in argv]


class PinMemo:
    """The record of one run's pinned host memory: the sizes of the slabs its steps used
    (NOTE [ Pinning ahead ]).

    Example::

        memo = PinMemo(settings={"lms": 1000.0}, device="NVIDIA H200:0", limit=12 << 30)
        pool.pin_slabs(memo.recalled)    # the slabs the last run of this command used ([]: none)
        memo.saw(pool.used_slabs())      # after each step
        memo.close()                     # as the run ends
    """

    def __init__(self, settings: dict, device: str, limit: int):
        base = [_command(), os.getcwd(), socket.gethostname(), os.environ.get("LOCAL_RANK", "0"),
                device, limit, sorted((k, repr(v)) for k, v in settings.items())]
        text = json.dumps(base, default=repr)
        _runs[text] += 1
        key = hashlib.sha256(f"{text}#{_runs[text]}".encode()).hexdigest()[:20]
        self.path = os.path.join(pins_dir(), f"{key}.json")
        self.command = base[0]
        self.recalled = self._read()     # the slabs the last run used, oldest first
        self.written = sum(self.recalled)    # the bytes of the slabs the record holds now
        self.slabs: List[int] = []       # the largest layout this run used at a step's end

    def _folder(self) -> str:
        """The records' folder, made if need be; '' if it cannot be trusted or made (said once,
        NOTE [ Trusting the cache ], Rule 2)."""
        folder = os.path.dirname(self.path)
        why = trusted_dir(folder)
        if why:
            say_once(f"lmsrt: pin records are off: {why}; use a folder of your own that others "
                     "cannot write (chmod go-w), or set LMSRT_CACHE to one (pin_ahead=False "
                     "turns records off)")
            return ""
        return folder

    def _read(self) -> List[int]:
        if not os.path.lexists(os.path.dirname(self.path)) or not self._folder():
            return []
        try:
            data = _read_small(self.path, _MAX_RECORD)
            return [] if data is None else _record_slabs(data)
        except (OSError, ValueError, RecursionError) as e:
            say_once(f"lmsrt: ignoring the pin record {self.path}: {e}; delete it (the next run "
                     "writes a new one)")
            return []

    def _write(self, slabs: List[int]) -> None:
        if len(slabs) > _MAX_SLABS:     # a record that the next run would refuse
            return
        folder = self._folder()
        if not folder:
            return
        record = {"slabs": slabs, "command": self.command,
                  "written": time.strftime("%Y-%m-%dT%H:%M:%S")}
        fresh = not os.path.lexists(self.path)
        try:
            write_file(self.path, json.dumps(record))
        except OSError:
            return
        self.written = sum(slabs)
        if fresh:
            _prune(folder)

    def saw(self, slabs: List[int]) -> None:
        """The slabs that requests have used by the end of a step; written once their bytes pass
        the record's by a sixteenth."""
        total = sum(slabs)
        if total > sum(self.slabs):
            self.slabs = list(slabs)
            if total > self.written + (self.written >> 4):
                self._write(self.slabs)

    def close(self) -> None:
        """The run ends: a record a sixteenth over what it used is brought down to that."""
        total = sum(self.slabs)
        if total and total < self.written - (self.written >> 4):
            self._write(self.slabs)
