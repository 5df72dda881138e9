"""The settings of an LMS, in one table, and how each is checked and spelled.

Each setting is one ``Option`` in ``OPTIONS``: its name (the ``LMSConfig`` field, the ``LMS``
keyword and the key of ``LMS.stats()["config"]``), default, type and unit, environment variable,
``lmsrt run`` flag, help text, and what it accepts. Derived from it: ``LMSConfig``'s fields and
checks and ``LMSConfig.from_env`` (``lmsrt.config``), the setting options of ``lmsrt run``
(``lmsrt._cli._types``), ``LMS.stats()["config"]``, and messages that tell a user which setting
to change (``spelled``). A new setting is a new row here, plus the code that uses it;
tests/test_options.py fails if one of those places misses it.

Example::

    from lmsrt.options import OPTIONS, spelled
    OPTIONS["lms_frac"].default      # 'auto'
    spelled("host_budget_gb")        # '--host-budget-gb, LMSRT_HOST_BUDGET_GB'

NOTE [ Settings are checked as byte counts ]
The engine, the host pool and the native arena use lms, prefetch_mb and host_budget_gb as
integer byte counts (``min_bytes``, ``prefetch_bytes``, ``host_budget_bytes``), held in 64 bits
wherever they meet C++ or CUDA. A finite float can still overflow that conversion (1e306 KB is
infinite bytes), so a setting is valid when the byte count it converts to, by the same
``byte_count`` the properties use, is at most MAX_BYTES; ``setting_range`` gives the values that
pass, for the CLI to check its flags by the same rule.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import textwrap
from typing import Callable, Dict, Literal, Optional, Tuple, Union

from .units import GiB, KiB, MiB

__all__ = ["AUTO", "MAX_BYTES", "OPTIONS", "Option", "byte_count", "check", "cuda_index",
           "describe", "env_value", "format_setting", "parse_env", "setting_range", "spelled"]

AUTO = "auto"           # lms_frac="auto": the engine finds the fraction itself
MAX_BYTES = 2**63 - 1


def cuda_index(spec: Optional[str]) -> Optional[int]:
    """The CUDA index a device string names (None for ``None``/``"cuda"``: the current device).

    Raises ValueError for anything but ``None``, ``"cuda"``, ``"cuda:N"``, ``"sim"``.
    """
    if spec is None or spec == "cuda" or spec in ("sim", "simulated"):
        return None
    number = spec[5:] if spec.startswith("cuda:") else ""
    if not number.isdigit():
        raise ValueError(f"device must be 'cuda', 'cuda:N' (N = 0, 1, ...), 'sim' or None, got "
                         f"{spec!r}")
    return int(number)


def _check_device(value: object) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"device must be None or a string: 'cuda', 'cuda:N' or 'sim', got "
                        f"{type(value).__name__} {value!r}")
    cuda_index(value)
    return value


_ON, _OFF = ("on", "true", "1", "yes"), ("off", "false", "0", "no")


def _check_switch(name: str) -> Callable[[object], bool]:
    """The check of an on/off setting ``name``: a bool, or one of the words of ``_ON``/``_OFF``
    (as its variable and flag give it)."""
    def switch(value: object) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _ON + _OFF:
            return value.strip().lower() in _ON
        raise (ValueError if isinstance(value, str) else TypeError)(
            f"{name} must be True or False (on or off), got {type(value).__name__} "
            f"{_shown(value)}; give e.g. {name}=True")
    return switch


def _check_word(name: str, words: Tuple[str, ...]) -> Callable[[object], str]:
    """The check of a setting ``name`` that is one of ``words``."""
    def word(value: object) -> str:
        if isinstance(value, str) and value.strip().lower() in words:
            return value.strip().lower()
        raise (ValueError if isinstance(value, str) else TypeError)(
            f"{name} must be one of {', '.join(words)}, got {type(value).__name__} "
            f"{_shown(value)}; give e.g. {name}={words[0]!r}")
    return word


_STATE_PLACES = (AUTO, "host", "gpu")      # optimizer_state's words


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting. A number unless ``check`` replaces the number check (``device``): a byte
    count when ``scale`` is set (NOTE [ Settings are checked as byte counts ]), else a number
    within ``bounds``; also one of ``words``, or None when ``none``."""

    name: str                   # LMSConfig field, LMS keyword, key of stats()["config"]
    default: object
    type: object                # the LMSConfig field's annotation
    env: str                    # the LMSRT_* variable LMSConfig.from_env reads
    flag: Optional[str]         # lmsrt run's flag; None: Python and the environment only
    doc: str                    # what it means, for docstrings
    what: str                   # what a value is, in error messages: "KiB; <= 0 turns ..."
    example: str                # a value to suggest in error messages
    metavar: str = ""           # the flag's value in --help
    help: str = ""              # the flag's help (its variable is added)
    give: str = ""              # the flag's error messages: "give {give}, e.g. {flag} {example}"
    unit: str = ""              # of a byte count: "KiB", "MiB", "GiB"
    scale: int = 0              # bytes per unit of a byte count; 0: not a byte count
    signed: bool = False        # a byte count that may be negative
    bounds: Tuple[float, float] = (0.0, 1.0)   # of a number that is no byte count
    words: Tuple[str, ...] = ()                # strings accepted besides numbers
    none: bool = False                         # None accepted
    check: Optional[Callable[[object], object]] = None


OPTIONS: Dict[str, Option] = {o.name: o for o in (
    Option("lms", 1000.0, float, "LMSRT_LMS", "--lms",
           doc="size threshold in KiB, as Caffe's ``-lms``: saved tensors smaller than this stay "
               "on the GPU. ``lms <= 0`` turns swapping off, so a flag can disable it.",
           what="KiB; <= 0 turns swapping off", example="1000", metavar="KIB",
           help="Saved tensors smaller than this stay on the GPU.",
           give="the size threshold in KiB (0 turns swapping off)",
           unit="KiB", scale=KiB, signed=True),
    Option("lms_frac", AUTO, Union[float, Literal["auto"]], "LMSRT_LMS_FRAC", "--lms-frac",
           doc="no swapping while this process's GPU use stays under ``lms_frac`` times the "
               "memory it may use (the device's total, or the per-process cap when one is set); "
               "above it, swap as little as is needed to stay under. In [0, 1]; 0 swaps every "
               "eligible tensor. ``\"auto\"`` (the default): lmsrt learns the model's own GPU use "
               "over the first step and keeps what it holds under what is left.",
           what="in [0, 1]", example="0.75", metavar="F|auto",
           help="No swapping while GPU use is under F times what the process may use; auto: "
                "lmsrt learns the model's own use and finds it.",
           give="the fraction of GPU memory used before swapping starts, or auto",
           words=(AUTO,)),
    Option("prefetch_mb", 4096.0, float, "LMSRT_PREFETCH_MB", "--prefetch-mb",
           doc="the most bytes (MiB) brought back ahead of backward and not yet used.",
           what="MiB, >= 0", example="4096", metavar="MB",
           help="Most bytes brought back ahead of backward.", give="MiB",
           unit="MiB", scale=MiB),
    Option("host_budget_gb", None, Optional[float], "LMSRT_HOST_BUDGET_GB", "--host-budget-gb",
           doc="the most pinned host memory (GiB) this process may use; ``None`` takes 80% of "
               "the free host memory (cgroup-aware), shared among the ranks of this node.",
           what="GiB, >= 0, or None for 80% of the free host memory", example="64",
           metavar="G", help="Most pinned host memory per process.", give="GiB per process",
           unit="GiB", scale=GiB, none=True),
    Option("recompute", True, bool, "LMSRT_RECOMPUTE", "--recompute",
           doc="rebuild cheap saved tensors in backward (GELU's and LayerNorm's outputs, "
               "autocast's casts) from their inputs instead of moving them, where lmsrt would "
               "otherwise swap them; each kind is first checked bit for bit against a copy (on "
               "by default). Also recompute whole repeated blocks (a transformer's layers, a conv "
               "net's stages) in backward where moving their activations would cost more step "
               "time (lmsrt/recompute/regions.py). Rebuilds read parameters as they are in "
               "backward: turn it "
               "off where they change between forward and backward (through .data, FSDP or "
               "ZeRO-3 resharding).",
           what="on or off", example="on", metavar="on|off",
           help="Rebuild cheap saved tensors (GELU, LayerNorm, casts) and recompute repeated "
                "blocks instead of moving them.",
           give="on or off", check=_check_switch("recompute")),
    Option("optimizer_state", AUTO, Literal["auto", "host", "gpu"], "LMSRT_OPTIMIZER_STATE",
           "--optimizer-state",
           doc="where torch.optim optimizers keep their state (AdamW's moments, SGD's momentum) "
               "between optimizer steps. ``\"auto\"`` (the default): on the GPU, unless the "
               "step that created it would not fit with it beside its peak; then in pinned host "
               "memory, brought back for each optimizer step. ``\"host\"``: always there; "
               "``\"gpu\"``: never (lmsrt/movers/optimizer.py).",
           what="auto, host or gpu", example="host", metavar="auto|host|gpu",
           help="Keep optimizer state in host memory between optimizer steps: auto (where it "
                "would not fit), host (always) or gpu (never).",
           give="auto, host or gpu", words=_STATE_PLACES,
           check=_check_word("optimizer_state", _STATE_PLACES)),
    Option("pin_ahead", True, bool, "LMSRT_PIN_AHEAD", "--pin-ahead",
           doc="as the LMS is created, start pinning (in the background) the host memory that "
               "the last run of the same command, GPU, cap and settings used, remembered under "
               "``$LMSRT_CACHE/pins``, so the first step does not wait for pinning (on by "
               "default; off neither reads nor writes the record).",
           what="on or off", example="on", metavar="on|off",
           help="Pin at start what the last run of this command used.",
           give="on or off", check=_check_switch("pin_ahead")),
    Option("device", None, Optional[str], "LMSRT_DEVICE", None,
           doc="``\"cuda\"``, ``\"cuda:N\"``, ``\"sim\"`` (CPU tensors stand in for GPU ones, "
               "for tests) or ``None`` (the current CUDA device; without one LMS is a no-op).",
           what="'cuda', 'cuda:N' or 'sim'", example="cuda:0", check=_check_device),
)}


def spelled(name: str, value: object = None) -> str:
    """The ways into a setting outside Python, for messages: ``'--lms-frac, LMSRT_LMS_FRAC'``;
    with a ``value``, ``'--lms-frac 0.5, LMSRT_LMS_FRAC=0.5'``."""
    option = OPTIONS[name]
    if value is None:
        return ", ".join(way for way in (option.flag, option.env) if way)
    shown = format_setting(value)
    return ", ".join(way for way in (option.flag and f"{option.flag} {shown}",
                                     f"{option.env}={shown}") if way)


def format_setting(value: object) -> str:
    """A setting's value as a person reads it: ``0.75``, ``auto``, ``on``, ``None``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value if isinstance(value, str) else "None" if value is None else f"{value:g}"


def env_value(value: object) -> str:
    """A setting's value as its ``LMSRT_*`` variable holds it, exactly (``repr`` of a float)."""
    if isinstance(value, bool):
        return format_setting(value)
    return value if isinstance(value, str) else repr(value)


def describe(indent: int, width: int = 96) -> str:
    """The settings as the ``Args:`` lines of a docstring, indented by ``indent``."""
    lines = []
    for option in OPTIONS.values():
        lines += textwrap.wrap(f"{option.name}: {option.doc}", width, initial_indent=" " * indent,
                               subsequent_indent=" " * (indent + 4))
    return "\n".join(lines)


def byte_count(name: str, value: float) -> int:
    """The bytes a value of the byte-count setting ``name`` stands for."""
    return int(value * OPTIONS[name].scale)


def _largest(scale: int) -> float:
    """The largest float whose byte count fits in MAX_BYTES."""
    value = MAX_BYTES / scale
    while int(value * scale) > MAX_BYTES:
        value = math.nextafter(value, 0.0)
    return value


def setting_range(name: str) -> Tuple[float, float]:
    """The numbers a setting accepts, both ends included.

    Example::

        low, high = setting_range("prefetch_mb")    # (0.0, 8796093022207.999)
    """
    option = OPTIONS[name]
    if option.check is not None:
        raise ValueError(f"{name} is not a number")
    if not option.scale:
        return option.bounds
    high = _largest(option.scale)
    return (-high if option.signed else 0.0), high


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"


def _or_words(option: Option, quote: bool) -> str:
    return "".join(f" or {w!r}" if quote else f" or {w}" for w in option.words)


def _instead(option: Option, name: str, var: bool) -> str:
    """What to give instead, as the end of an error message about ``name``."""
    if var:
        values = (option.example, *option.words)
        return f"set it to e.g. {' or '.join(f'{name}={v}' for v in values)}, or unset it"
    values = (option.example, *map(repr, option.words))
    return f"give e.g. {' or '.join(f'{name}={v}' for v in values)}"


def _check_number(option: Option, value: object, name: str, var: bool) -> object:
    """``value`` within ``setting_range``, or one of the option's words; TypeError or ValueError
    naming it ``name`` (an environment variable if ``var``), saying what it may be and giving an
    example."""
    what, got, instead = option.what, f"got {_shown(value)}", _instead(option, name, var)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number ({what}){_or_words(option, True)}, got "
                        f"{type(value).__name__} {_shown(value)}; {instead}")
    if isinstance(value, numbers.Integral) and abs(int(value)) > MAX_BYTES:
        number = math.inf if value > 0 else -math.inf     # 10**400: no float holds it
    else:
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"{name} must be finite ({what}), {got}; {instead}")
    low, high = setting_range(option.name)
    if low <= number <= high:
        return number
    if not option.scale:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], {got}; {instead}")
    if low == 0 and number < 0:
        none = " or None" if option.none else ""
        raise ValueError(f"{name} must be >= 0 {option.unit}{none}, {got}; {instead}")
    raise ValueError(f"{name} must be in [{low:.6g}, {high:.6g}] {option.unit} (its byte count "
                     f"must fit in 64 bits), {got}; {instead}")


def check(name: str, value: object, var: Optional[str] = None) -> object:
    """``value`` as the setting ``name`` stores it; TypeError/ValueError naming the setting, or
    the environment variable ``var`` it came from, and saying what to give instead."""
    option = OPTIONS[name]
    if option.check is not None:
        return option.check(value)
    if value is None and option.none:
        return None
    if isinstance(value, str) and value in option.words:
        return value
    return _check_number(option, value, var or name, var is not None)


def parse_env(name: str, raw: str) -> object:
    """The value of setting ``name``'s ``LMSRT_*`` variable, ``raw``, as the setting takes it
    (not yet checked: ``check`` does that)."""
    option = OPTIONS[name]
    if option.check is not None or raw in option.words:
        return raw
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{option.env}={raw!r} is not a number{_or_words(option, False)}; "
                         f"{_instead(option, option.env, True)}") from None
