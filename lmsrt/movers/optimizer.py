"""Optimizer state in pinned host memory between optimizer steps.

NOTE [ Optimizer state on the host ]
AdamW's two moments take twice the parameters' bytes and sit on the GPU through every forward
and backward, where nothing reads them. The mover keeps them in the engine's pinned pool between
optimizer steps and brings them back for the step:

  Rule 1 (when, and how much). ``optimizer_state="host"``: all of it, from each optimizer's
    first step (that step made in parts where Rule 7 allows, else moved at its end). ``"gpu"``:
    never. ``"auto"`` (the default), at the step that makes an optimizer's state: where Rule 7
    allows parts, once the step's closure ran, if the state it will make (the class's copies of
    each parameter that has a gradient) and the update's temporaries (a copy of those
    parameters) do not fit beside what is allocated (``policy.step_fits``), that step makes it
    on the host, in parts. Else at its end, if the step's peak before the optimizer ran plus
    the state it made does not fit: the next forward would hold the state on top of what just
    fitted, and a learning step's peak is the least the engine can hold. State found on the
    device at an optimizer's first step (loaded to resume a run) is judged as if that step had
    made it (its bytes taken off the peak they were in); where the step would not fit whole, it
    goes out before the step. Under cuDNN's benchmark mode the step that made the state is not
    judged (its algorithm search takes what memory there is): the next one is, its state
    counted as found. Then only what must leave leaves: the state of the parameters
    with the least of it, up to what fits beside that peak with a margin
    (``policy.room_beside``; after a step in parts, also beside what the step began with and
    its next parts), stays on the device for the run, the rest moves each step. The choice
    holds for the run. (The arithmetic of these answers: placement.py.)
  Rule 2 (what). Each tensor of the state on this device, of ``lms`` KiB or more, that is its
    storage's whole (``exp_avg``, ``momentum_buffer``; not Adam's ``step`` scalar). Its bytes
    have a slot of the pool for the run; the state dict then holds a CPU tensor over that slot.
  Rule 3 (in). Inside a step (between torch.optim's global step pre- and post-hooks) the first
    read of ``optimizer.state`` brings all of it back: where forward and backward run inside the
    step (a closure), after them. The copies in wait for the last write-back before the step
    began (one D2H stream, so its last event covers every earlier copy; the step's own
    write-backs are of other places, Rule 7), and the compute stream waits for them.
  Rule 4 (out). At the step's post-hook each state tensor on the GPU is copied out once the
    step's kernels are queued (NOTE [ Stream lifetimes ], Rule 1) and let go: its block is not
    reused before the copy has run (``Device.free_after``, Rule 2). The dict then holds the host
    tensors.
  Rule 5 (read between steps). Outside a step, reading the state (``state[p]``, ``get``,
    ``items()``, ``values()``; ``state_dict()`` reads items) first waits for write-backs in
    flight and gives the host tensors: the exact bytes, on the CPU. A dict put in place by
    ``load_state_dict`` is moved out again at the end of the next step.
  Rule 6 (close). Closing the LMS brings the state back to the GPU, where the optimizer expects
    it; if it does not fit there, it stays on the CPU, said once.
  Rule 7 (in parts; streamed.py). Where the state is on the host, a step of a torch.optim class
    whose update is per parameter (SGD, Adam, AdamW, ...) runs in parts of about ``part_bytes``
    of state each (a sixteenth of the limit), so the step holds about three parts (the one
    running, the next coming in, the last going out: a part's copies in wait for the write-back
    of the part two before it), not all of it: the parameter groups are narrowed to a part's
    parameters, and the next part's state comes in while a part runs. Before a part's blocks are
    asked for, the host waits for the write-back two parts before (a GPU-side wait alone lets the
    host run ahead: the allocator, finding those blocks still in flight, asks for new ones, and
    at the limit frees its cache and synchronizes to go on; measured on a 1.5B Llama at a 16 GiB
    cap: five such retries a step). Only where no step hooks
    but lmsrt's are set (a user's hook would see a part, not the step), the class's own
    ``step`` is torch's, and not under torch.compile (Rule 8). A closure runs first, in the
    pre-hook, with the groups whole (it may zero their gradients), as the step would run it;
    then the groups are emptied, so the step's own body does nothing, and every part runs in
    the post-hook, with the step's arguments: a part that raises there leaves the groups whole
    (a step left by an exception skips torch's post-hooks; one that raised in a pre-hook is
    made whole at the next read or step). Each group's choice of foreach or loop is made once,
    from the whole group; per-parameter updates make the parts' arithmetic the step's, bit for
    bit.
  Rule 8 (compiled steps). A step compiled with torch.compile guards on its state's addresses and
    keeps the tensors it was compiled with: state brought back each step would recompile it
    each step and hold every old copy. Its state stays on the device (brought back for good if
    it had moved), said once. A step captured in a CUDA graph is left alone (no copies, events
    or host waits inside a capture).
  Rule 9 (what the engine is judged by). The step's peak as the optimizer's first read finds
    it (after a closure's forward and backward) is the training pass's (marks.py; read
    again at a later read that finds the peak past the one seen at the last read or update's
    end: a backward after one optimizer's step, as a GAN's loop has): the engine's policy
    corrects its plan of saved tensors by that, not by the whole step's, whose update (state
    brought in, parts, temporaries) no plan of saved tensors can lower. (Judged by the whole
    step's, a 1.5B Llama's update in parts, 3.7 GiB over its training pass at a 16
    GiB cap, raised the plan's correction by 0.9 GiB every step, without end.) The allocator's
    retries count the whole step's: room the update needed beside the pass's cache is room
    the pass must leave. And a step's parts are sized by the room beside what is allocated
    when it begins (``Placement.part_size``): a fifth of it each (three held, the update's
    temporaries, the allocator's slack), a sixteenth of the limit at most. (With parts of a
    sixteenth, the Llama's update held 3.9 GiB beside 11 GiB of parameters and gradients and
    ran out of memory at the cap in its eleventh step.) Where one parameter's state is more
    than a fifth of that room (a part cannot be smaller), a part's copies in wait for the
    write-back of the part just before it: two parts held, not three (``Placement.depth``);
    where two are more than the room, none comes ahead: each part comes in once the one before
    it is out, one held. (Measured on an H200 at a 544 MiB cap: parameters and gradients of
    384 MiB and two cuBLAS workspaces of 33 MiB, one per thread, left 41 MiB of room for parts
    of 32 MiB; two held ran out of memory in AdamW's update.)

Exact: the optimizer's arithmetic is the same, on the same bytes.
"""
from __future__ import annotations

import collections
import weakref
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .. import torch_patches
from ..options import OPTIONS, spelled
from ..recompute.compiled import capturing
from ..say import say_once
from ..units import format_bytes
from .host_state import HostState, Place, in_groups, on_host, part_sizes, states
from .marks import StepMarks
from .placement import Placement
from .streamed import Parts, closure_of, may_cut, run_closure, state_to_come, with_closure

__all__ = ["OptimizerMover", "MODES"]

MODES = OPTIONS["optimizer_state"].words     # ("auto", "host", "gpu")

_movers: List["weakref.ref"] = []      # open movers of live engines, oldest first


class _Tracked:
    """One optimizer as the mover sees it."""

    __slots__ = ("places", "moved", "fetched", "in_step", "created", "found", "peak_before",
                 "at_step", "parts", "resident", "stays", "again", "deferred", "began",
                 "__weakref__")

    def __init__(self):
        self.places: Dict[Tuple[int, str], Place] = {}   # (id(param), key) -> its host place
        self.moved = False          # its state lives on the host between steps (Rule 1)
        self.fetched = False        # this step (or part) has brought its state in (Rule 3)
        self.in_step = False        # between its step's pre- and post-hook
        self.created = False        # this step makes its state, or found it (Rule 1)
        self.found = 0              # bytes of state on the device when first seen (loaded)
        self.peak_before = 0        # the engine's step peak when its step began
        self.at_step = 0            # allocated then, after its closure
        self.parts: Optional[Parts] = None     # this step's parts, when streamed (Rule 7)
        self.resident: set = set()  # ids of parameters whose state stays on the device (Rule 1)
        self.stays = False          # its step is compiled: its state stays on the device (Rule 8)
        self.again = False          # judged at the next step's end instead (cuDNN's search)
        self.deferred = False       # that was done once
        self.began = None           # the event its update began at (timed if its state moved)


class OptimizerMover:
    """Moves the state of torch.optim optimizers to pinned host memory between their steps, and
    back for each step (NOTE [ Optimizer state on the host ]). One per engine, which reads
    ``figures()`` into each step's stats and calls ``new_step()`` and ``close()``.

    Example::

        mover = OptimizerMover(device, copies, host, threading.RLock(), min_bytes=1 << 20,
                               mode="host", step_peak=lambda: 0, fits=lambda peak: True,
                               room=lambda peak: 0, part_bytes=1 << 30)
        optimizer.step()        # from the end of this step its state lives on the host
    """

    steps_seen = 0      # optimizer steps any mover's hooks saw in this process (for texts)

    def __init__(self, device, copies, host, lock, *, min_bytes: int, mode: str,
                 step_peak: Callable[[], int], fits: Callable[[int], bool],
                 room: Callable[[int], int], part_bytes: int):
        if mode not in MODES:
            raise ValueError(f"optimizer_state must be one of {', '.join(MODES)}, got {mode!r}")
        self.device, self.copies, self.host, self.lock = device, copies, host, lock
        self.min_bytes, self.mode = min_bytes, mode
        self.step_peak = step_peak
        self.placement = Placement(mode, fits, room, part_bytes)     # Rule 1
        self._tracked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._written = None          # the last write-back's event (Rules 3, 5)
        self._written_before = None   # and the last one before the step in flight began
        self._said: set = set()
        self.in_bytes = self.out_bytes = 0       # this step's
        self.marks = StepMarks(device, step_peak)           # Rule 9
        self.closed = False
        # Every mover is in the list, so that the newest LMS decides ("gpu" included); the
        # hooks are made for the ones that move.
        _movers.append(weakref.ref(self))
        if mode != "gpu":
            _hooks.add_user(self)

    # -- the step's hooks ----------------------------------------------------------------------

    def before_step(self, optimizer, args: tuple, kwargs: dict,
                    compiled: bool = False) -> Optional[tuple]:
        if self.mode == "gpu":
            return None
        tracked = self._tracked.get(optimizer)
        first = tracked is None
        if first:
            tracked = self._tracked[optimizer] = _Tracked()
            # An optimizer dropped gives its host places back.
            weakref.finalize(optimizer, _forget, weakref.ref(self), tracked)
        self._mend(optimizer, tracked)
        if compiled and not tracked.stays:
            self._stay(optimizer, tracked)      # Rule 8
        if tracked.stays:
            return None
        tracked.in_step, tracked.fetched = True, False
        self._written_before = self._written
        cut = may_cut(optimizer) and not compiled
        if tracked.moved:
            if not cut:
                return self._after_closure(args, kwargs, tracked)
            args, kwargs = run_closure(args, kwargs)
            tracked.began = self.marks.pass_ends()
            per = part_sizes(optimizer, tracked.places)
        else:
            on_device = sum(t.untyped_storage().nbytes()
                            for _, _, _, t in self._on_device(optimizer, tracked))
            # State made by this step, or found on the device at the first sight (loaded by
            # load_state_dict to resume a run): both are judged at this step's end (Rule 1).
            tracked.found = on_device if first or tracked.again else 0
            tracked.created = first or tracked.again or not on_device
            tracked.again = False
            if not (cut and tracked.created):
                tracked.peak_before = self._peak_without(tracked)
                return self._after_closure(args, kwargs, tracked, judge=True)
            args, kwargs = run_closure(args, kwargs)     # what it holds counts (Rule 1)
            tracked.began = self.marks.pass_ends()
            tracked.peak_before = self._peak_without(tracked)
            tracked.at_step = self.device.memory_allocated()
            per = state_to_come(optimizer) if not on_device else {}
            temporaries = sum(p.numel() * p.element_size() for p in in_groups(optimizer)
                              if p.grad is not None)
            if not self.placement.moves_before(tracked.at_step, sum(per.values()), temporaries):
                return args, kwargs
            tracked.moved = True
            if on_device:                       # found: out now, in again part by part
                with self.lock:
                    self._write_back(optimizer, tracked)
                # The parts' copies in read what these write-backs write (Rule 3).
                self._written_before = self._written
                tracked.at_step -= on_device
                per = part_sizes(optimizer, tracked.places)
        allocated = self.device.memory_allocated()
        parts = Parts.plan(optimizer, per, self.placement.part_size(allocated))   # Rules 7, 9
        if parts is not None:
            parts.depth = self.placement.depth(allocated, parts.largest)
            parts.begin(optimizer)
            tracked.parts = parts
        return args, kwargs

    def _after_closure(self, args: tuple, kwargs: dict, tracked: _Tracked, judge=False):
        """A step's arguments whose closure, if any, marks the training pass's end (Rule 9) and,
        to ``judge`` it, reads the step's peak once forward and backward ran in it (Rule 1
        judges the step by that peak); None where it has none (the pass ended: marked now)."""
        closure = closure_of(args, kwargs)
        if closure is None:
            tracked.began = self.marks.pass_ends()
            return None

        def then_the_peak():
            loss = closure()
            tracked.began = self.marks.pass_ends()
            if judge:
                tracked.peak_before = self._peak_without(tracked)
            return loss
        return with_closure(args, kwargs, then_the_peak)

    def _peak_without(self, tracked: _Tracked) -> int:
        """The step's peak so far, less the state found on the device (it was in it)."""
        peak = self.step_peak()
        return peak - min(tracked.found, peak)

    def _mend(self, optimizer, tracked: _Tracked) -> None:
        """Where the last step raised inside a part: its groups whole again."""
        if tracked.parts is not None:
            with self.lock:
                self._end_parts(optimizer, tracked.parts)
            tracked.parts = None

    def _end_parts(self, optimizer, parts: Parts) -> None:
        """The groups whole again, and the part that was coming in (after a part that raised)
        waited for: it is in the state dict, on the device."""
        if parts.ahead is not None:
            parts.ahead.wait(self.device.current_stream())
            parts.ahead = None
        parts.end(optimizer)

    def _stay(self, optimizer, tracked: _Tracked) -> None:
        """Rule 8: a compiled step's state on the device for good."""
        tracked.stays = True
        if tracked.moved:
            with self.lock:
                self._bring_back(optimizer, tracked)
            tracked.moved = False
        say_once("optimizer-state-compiled",
                 f"lmsrt: {type(optimizer).__name__}'s step is compiled (torch.compile): its "
                 "state stays on the GPU, where the compiled step finds it at the same "
                 "addresses each step (said once).", given=self._said)

    def after_step(self, optimizer, args: tuple, kwargs: dict) -> None:
        tracked = self._tracked.get(optimizer)
        if tracked is None or not tracked.in_step:
            return                  # its pre-hook ran before this mover was made
        tracked.in_step = False
        if (not tracked.moved and tracked.created and not tracked.deferred
                and self.mode == "auto" and self.device.tunes_algorithms()):
            # The step that made (or found) the state also ran cuDNN's search, whose workspaces
            # take what memory there is: its peak says nothing of the model's. The next step,
            # with the algorithms chosen, is judged instead, its state counted as found.
            tracked.again = tracked.deferred = True
            return
        if not tracked.moved and not self._should_move(optimizer, tracked):
            return
        tracked.moved = True
        parts, tracked.parts = tracked.parts, None
        # What may stay on the device, chosen where all of the state the step made is at hand:
        # on the device before its write-back, or on the host after a step in parts.
        keep = tracked.created and self.mode == "auto"
        if keep and parts is None:
            self._keep_resident(optimizer, tracked, None)
        tracked.created = False
        with self.lock:
            self._write_back(optimizer, tracked)
            if parts is not None:
                try:
                    parts.run(optimizer, args, kwargs, lambda: self._next_part(
                        optimizer, tracked, parts))
                    self._write_back(optimizer, tracked)        # the last part's
                finally:
                    self._end_parts(optimizer, parts)
                if keep:
                    self._keep_resident(optimizer, tracked, tracked.at_step)
            self._sweep(optimizer, tracked)
        if tracked.began is not None:
            self.marks.update_ends(tracked.began)       # timed: its state moved
            tracked.began = None

    def _next_part(self, optimizer, tracked: _Tracked, parts: "Parts") -> None:
        """Between two parts (Rule 7): the last one's state out, the next one's in."""
        self._write_back(optimizer, tracked)
        parts.written.append(self._written)
        parts.narrow(optimizer)
        tracked.fetched = False
        self._fetch(optimizer, tracked, parts)

    def _should_move(self, optimizer, tracked: _Tracked) -> bool:
        """Rule 1, at the end of the step that made the state on the device."""
        if self.mode != "host" and not tracked.created:
            return False
        made = sum(t.untyped_storage().nbytes()
                   for _, _, _, t in self._on_device(optimizer, tracked))
        return self.placement.moves_after(tracked.peak_before, made)

    def _keep_resident(self, optimizer, tracked: _Tracked, began: Optional[int]) -> None:
        """Rule 1: what of the state the step made stays on the device (``Placement.stays``;
        ``began``: what the step began with, where it ran in parts)."""
        sizes: Dict[int, int] = {}
        for p, _, _, t in self._on_device(optimizer, tracked):
            sizes[id(p)] = sizes.get(id(p), 0) + t.untyped_storage().nbytes()
        for where, place in tracked.places.items():
            sizes[where[0]] = sizes.get(where[0], 0) + place.slot.nbytes
        tracked.resident = self.placement.stays(sizes, tracked.peak_before, began)
        kept = sum(sizes[pid] for pid in tracked.resident)
        total = sum(sizes.values())
        say_once("optimizer-state",
                 f"lmsrt: {type(optimizer).__name__}'s state ({format_bytes(total)}) would not "
                 f"fit beside {format_bytes(tracked.peak_before)} under the limit: "
                 f"{format_bytes(total - kept)} of it lives in pinned host memory between "
                 "optimizer steps from now on and comes back for each step (said once; "
                 f"{spelled('optimizer_state', 'gpu')} keeps it all on the GPU).",
                 given=self._said)

    # -- reads (Rules 3, 5) --------------------------------------------------------------------

    def reading(self, optimizer) -> None:
        tracked = self._tracked.get(optimizer)
        if tracked is None or not tracked.moved or self.closed:
            return
        if tracked.in_step:
            if not tracked.fetched:
                with self.lock:
                    self._fetch(optimizer, tracked, tracked.parts)
            return
        self._mend(optimizer, tracked)
        if self._written is not None:               # Rule 5: its host bytes may be in flight
            self._written.synchronize()
            self._written = None

    def _fetch(self, optimizer, tracked: _Tracked, parts: Optional["Parts"] = None) -> None:
        """Rule 3: the host tensors of the parameters in ``optimizer``'s groups back on the
        device; and with ``parts``, the next part's on their way (Rule 7)."""
        tracked.fetched = True
        compute = self.device.current_stream()
        # What is not on its way already (a part fetched ahead is on the device in the dict).
        # A step's parts read places no write of the same step touches: the copies in wait
        # for the write-backs of the steps before only, and run beside this step's.
        after = self._written_before
        last = parts.written[-1] if parts is not None and parts.written else None
        if last is not None and not parts.depth:
            last.synchronize()                  # one part held: the last one's blocks free
        waits = [self._bring(optimizer, tracked, in_groups(optimizer), compute, after)]
        try:
            if parts is not None:
                waits.append(parts.ahead)
                following = parts.following() if parts.depth else []
                paced = parts.paced_by(after)
                if following and paced is not None and paced is not after:
                    paced.synchronize()         # its blocks free for these (Rule 7)
                parts.ahead = (self._bring(optimizer, tracked, following, compute, paced)
                               if following else None)
        finally:        # (also where the next part's blocks were refused: these are in the dict)
            for done in waits:
                if done is not None:
                    done.wait(compute)

    def _bring(self, optimizer, tracked: _Tracked, params: Optional[list], compute, after):
        """Start the copies in of the host tensors of ``params``' state (all of it: None), once
        the write event ``after`` (if any) has passed; the last one's event, or None."""
        if after is not None:
            after.wait(self.copies.h2d)
        done = None
        try:
            for _, p_state, key, place in on_host(optimizer, tracked.places, params):
                block = self.device.empty(place.slot.nbytes)
                done = self.copies.copy_in(block, place.slot, compute)
                p_state[key] = block.view(place.dtype).as_strided(place.size, place.stride)
                self.in_bytes += place.slot.nbytes
        except BaseException:
            # (out of memory, say, under a caller that goes on: the Trainer's batch-size
            # finder) What came in is in the dict already: no later read before its copy.
            if done is not None:
                done.wait(compute)
            raise
        return done

    def _write_back(self, optimizer, tracked: _Tracked) -> None:
        """Rule 4: every movable state tensor of the parameters in the groups out to its host
        place."""
        if not isinstance(optimizer.state, HostState) or optimizer.state._mover() is not self:
            optimizer.state = HostState(self, optimizer, optimizer.state)   # (a new dict)
        compute = self.device.current_stream()
        moving = [p for p in in_groups(optimizer) if id(p) not in tracked.resident]
        for p, p_state, key, t in list(self._on_device(optimizer, tracked, moving)):
            where = (id(p), key)
            nbytes = t.untyped_storage().nbytes()
            place = tracked.places.get(where)
            if place is None or not place.fits(t):
                if place is not None:
                    self.host.free(tracked.places.pop(where).slot)
                slot = self.host.alloc(nbytes, wait=True)
                if slot is None:
                    say_once("optimizer-state-host", "lmsrt: the host memory budget refused "
                             f"room for optimizer state ({format_bytes(nbytes)}): it stays on "
                             f"the GPU (said once; {spelled('host_budget_gb')} raises it).",
                             given=self._said)
                    continue
                place = tracked.places[where] = Place(slot, t)
            self._written = self.copies.copy_out(t.untyped_storage(), place.slot, compute)
            self.device.free_after(t, self.copies.d2h)              # Rule 4
            p_state[key] = place.host
            self.out_bytes += nbytes

    def _sweep(self, optimizer, tracked: _Tracked) -> None:
        """Give back the places whose tensors left the state (``load_state_dict``)."""
        held = {where for where, _, _, _ in on_host(optimizer, tracked.places)}
        for where in [w for w in tracked.places if w not in held]:
            self.host.free(tracked.places.pop(where).slot)

    # -- what is where -------------------------------------------------------------------------

    def _on_device(self, optimizer, tracked: _Tracked,
                   params: Optional[list] = None) -> Iterator[tuple]:
        """(param, its state, key, tensor) of each movable state tensor on the device (Rule 2),
        of ``params`` if given."""
        owns, least, places = self.device.owns, self.min_bytes, tracked.places
        for p, p_state in states(optimizer, params):
            for key, t in p_state.items():
                if type(t) is not torch.Tensor or not owns(t):
                    continue                       # (a DTensor's shards are FSDP's to move)
                place = places.get((id(p), key))
                if place is not None and t is place.host:
                    continue                       # on the host already (the simulated device)
                nbytes = t.untyped_storage().nbytes()
                if (nbytes >= least and t.storage_offset() == 0
                        and nbytes == t.numel() * t.element_size()):
                    yield p, p_state, key, t

    # -- the engine's calls --------------------------------------------------------------------

    def figures(self) -> Dict[str, int]:
        """This step's figures, by their ``StepStats`` names."""
        on_host = sum(place.slot.nbytes for tracked in list(self._tracked.values())
                      if tracked.moved for place in tracked.places.values())
        return {"optimizer_host_bytes": on_host, "optimizer_in_bytes": self.in_bytes,
                "optimizer_out_bytes": self.out_bytes,
                "optimizer_update_ms": self.marks.read_update_ms()}

    def new_step(self) -> None:
        self.in_bytes = self.out_bytes = 0
        self.marks.new_step()

    def _bring_back(self, optimizer, tracked: _Tracked) -> None:
        """Rules 6 and 8: the state of ``optimizer`` back on the device in a plain dict, its
        host places given back (the compute stream waits for the copies in before any later
        write can reach a place: Rule 5 of NOTE [ Stream lifetimes ])."""
        compute = self.device.current_stream()
        try:
            done = self._bring(optimizer, tracked, None, compute, self._written)
        except torch.OutOfMemoryError:
            say_once("optimizer-state-close", f"lmsrt: {type(optimizer).__name__}'s state did "
                     "not fit back on the GPU: it stays in host memory, and the optimizer's next "
                     "step fails on mixed devices (said once). Move it with "
                     "optimizer.load_state_dict(optimizer.state_dict()) once there is room.",
                     given=self._said, warn=True)
            return
        if done is not None:
            done.wait(compute)
        state = optimizer.state
        if isinstance(state, HostState):
            optimizer.state = collections.defaultdict(dict, dict.items(state))
        for place in tracked.places.values():
            self.host.free(place.slot)
        tracked.places.clear()

    def close(self) -> None:
        """Rule 6: the state back on the device, and this mover out of the hooks."""
        if self.closed:
            return
        self.closed = True
        if self.mode != "gpu":
            _hooks.remove_user(self)
        for optimizer, tracked in list(self._tracked.items()):
            self._mend(optimizer, tracked)
            if tracked.moved:
                self._bring_back(optimizer, tracked)
        self._tracked.clear()


def _mover_of(optimizer) -> "OptimizerMover | None":
    """The mover of ``optimizer``'s steps: the one whose dict it holds while that one is open,
    else the newest open one (a script that makes a new LMS leaves its old one behind)."""
    state = optimizer.state
    owner = state._mover() if isinstance(state, HostState) else None
    if owner is not None and not owner.closed:
        return owner
    _movers[:] = [ref for ref in _movers if ref() is not None and not ref().closed]
    return _movers[-1]() if _movers else None


def _forget(mover_ref, tracked: _Tracked) -> None:
    mover = mover_ref()
    if mover is not None:
        with mover.lock:
            for place in tracked.places.values():
                mover.host.free(place.slot)
            tracked.places.clear()


def _pre(optimizer, args, kwargs) -> Optional[tuple]:
    # Traced in a step compiled with torch.compile, which runs ``_pre_eager`` eagerly, between
    # its graphs: the step is then not cut (Rule 7), its parts would run eagerly.
    return _pre_eager(optimizer, args, kwargs, torch.compiler.is_compiling())


@torch.compiler.disable
def _pre_eager(optimizer, args, kwargs, compiled: bool) -> Optional[tuple]:
    mover = None if capturing() else _mover_of(optimizer)
    return None if mover is None else mover.before_step(optimizer, args, kwargs, compiled)


@torch.compiler.disable
def _post(optimizer, args, kwargs) -> None:
    OptimizerMover.steps_seen += 1
    # A step captured in a CUDA graph (a capturable optimizer under torch.cuda.graph): copies,
    # events and host waits would invalidate the capture; the mover steps aside, as LMS does.
    mover = None if capturing() else _mover_of(optimizer)
    if mover is not None:
        try:
            mover.after_step(optimizer, args, kwargs)
        finally:
            mover.marks.update_over()                   # Rule 9


# Made while a mover is open (torch_patches.py, NOTE [ What lmsrt changes in torch ], 9).
_hooks = torch_patches.optimizer_step_patch(_pre, _post)
