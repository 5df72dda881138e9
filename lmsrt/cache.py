"""What lmsrt keeps between runs, under ``$LMSRT_CACHE`` (default ``~/.cache/lmsrt``): the built
C++ copy path (copy_path.py) and, per run, the pinned host memory it used.

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
  garbage) is as no record; writes replace the file whole; the last ``_KEEP`` records are kept.
  ``pin_ahead=False`` (``--pin-ahead off``, ``LMSRT_PIN_AHEAD=off``) neither reads nor writes.
  Pins ahead take no more than the host budget allows, and those no step uses are given back
  after ``_IDLE_STEPS`` steps like any slab.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import socket
import sys
import time
from typing import List

__all__ = ["cache_root", "pins_dir", "PinMemo"]

_KEEP = 256                  # records kept in pins_dir(); the oldest go first
_runs: collections.Counter = collections.Counter()   # LMS objects made per run key, this process


def cache_root() -> str:
    """Where lmsrt keeps what outlives a run: ``$LMSRT_CACHE`` or ``~/.cache/lmsrt``."""
    return os.environ.get("LMSRT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                         "lmsrt")


def pins_dir() -> str:
    """The records of pinned host memory, one file per run (NOTE [ Pinning ahead ])."""
    return os.path.join(cache_root(), "pins")


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

    def _read(self) -> List[int]:
        try:
            with open(self.path) as f:
                slabs = json.load(f)["slabs"]
        except (OSError, ValueError, KeyError, TypeError):
            return []
        if not isinstance(slabs, list) or not all(type(n) is int and n > 0 for n in slabs):
            return []
        return slabs

    def _write(self, slabs: List[int]) -> None:
        record = {"slabs": slabs, "command": self.command,
                  "written": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(record, f)
            fresh = not os.path.exists(self.path)
            os.replace(tmp, self.path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        self.written = sum(slabs)
        if fresh:
            _prune(os.path.dirname(self.path))

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
