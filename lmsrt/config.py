"""Frozen configuration of an LMS instance, and how to read it from the environment."""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Dict, Mapping, Optional, Tuple

__all__ = ["LMSConfig", "ENV_VARS", "MAX_BYTES", "cuda_index", "setting_range"]

# Environment variable -> LMSConfig field, read by LMSConfig.from_env() and set by `lmsrt run`.
ENV_VARS = {
    "LMSRT_LMS": "lms",
    "LMSRT_LMS_FRAC": "lms_frac",
    "LMSRT_PREFETCH_MB": "prefetch_mb",
    "LMSRT_HOST_BUDGET_GB": "host_budget_gb",
    "LMSRT_DEVICE": "device",
}

# NOTE [ Settings are checked as byte counts ]
# The engine, the host pool and the native arena use lms, prefetch_mb and host_budget_gb as
# integer byte counts (``min_bytes``, ``prefetch_bytes``, ``host_budget_bytes``), held in 64 bits
# wherever they meet C++ or CUDA. A finite float can still overflow that conversion (1e306 KB is
# infinite bytes), so a setting is valid when the byte count it converts to, by the same
# ``_to_bytes`` the properties use, is at most MAX_BYTES; ``setting_range`` gives the values that
# pass, for the CLI to check its flags by the same rule.
MAX_BYTES = 2**63 - 1

# field -> (bytes per unit, unit, what the number is, an example value)
_BYTE_SETTINGS: Dict[str, Tuple[int, str, str, str]] = {
    "lms": (1024, "KB", "KB; <= 0 turns swapping off", "1000"),
    "prefetch_mb": (2**20, "MiB", "MiB, >= 0", "4096"),
    "host_budget_gb": (2**30, "GiB", "GiB, >= 0, or None for 80% of the free host memory", "64"),
}
_FRACTION = ("in [0, 1]", "0.75")     # lms_frac: what it is, an example


def _to_bytes(value: float, unit: int) -> int:
    return int(value * unit)


def _largest(unit: int) -> float:
    """The largest float whose byte count fits in MAX_BYTES."""
    value = MAX_BYTES / unit
    while _to_bytes(value, unit) > MAX_BYTES:
        value = math.nextafter(value, 0.0)
    return value


def setting_range(field: str) -> Tuple[float, float]:
    """The numbers a setting accepts, both ends included.

    Example::

        low, high = setting_range("prefetch_mb")    # (0.0, 8796093022207.999)
    """
    if field == "lms_frac":
        return 0.0, 1.0
    high = _largest(_BYTE_SETTINGS[field][0])
    return (-high if field == "lms" else 0.0), high


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"


def _check_number(field: str, value: object, name: str, var: bool) -> float:
    """``value`` as a float within ``setting_range(field)``; TypeError or ValueError naming it
    ``name`` (an environment variable if ``var``), saying what it may be and giving an example."""
    what, example = _FRACTION if field == "lms_frac" else _BYTE_SETTINGS[field][2:]
    got = f"got {_shown(value)}"
    instead = (f"set it to e.g. {name}={example}, or unset it" if var else
               f"give e.g. {name}={example}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number ({what}), got {type(value).__name__} "
                        f"{_shown(value)}; {instead}")
    if isinstance(value, numbers.Integral) and abs(int(value)) > MAX_BYTES:
        number = math.inf if value > 0 else -math.inf     # 10**400: no float holds it
    else:
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"{name} must be finite ({what}), {got}; {instead}")
    low, high = setting_range(field)
    if low <= number <= high:
        return number
    if field == "lms_frac":
        raise ValueError(f"{name} must be in [0, 1], {got}; {instead}")
    unit = _BYTE_SETTINGS[field][1]
    if low == 0 and number < 0:
        none = " or None" if field == "host_budget_gb" else ""
        raise ValueError(f"{name} must be >= 0 {unit}{none}, {got}; {instead}")
    raise ValueError(f"{name} must be in [{low:.6g}, {high:.6g}] {unit} (its byte count must fit "
                     f"in 64 bits), {got}; {instead}")


def _check_device(value: object) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"device must be None or a string: 'cuda', 'cuda:N' or 'sim', got "
                        f"{type(value).__name__} {value!r}")
    cuda_index(value)
    return value


def _checked(field: str, value: object, var: Optional[str] = None) -> object:
    """``value`` as ``field`` stores it; TypeError/ValueError naming the field, or the
    environment variable ``var`` it came from, and saying what to give instead."""
    if field == "device":
        return _check_device(value)
    if field == "host_budget_gb" and value is None:
        return None
    return _check_number(field, value, var or field, var is not None)


def _parse_env(var: str, field: str, raw: str) -> object:
    """The value of an ``LMSRT_*`` variable, as its field takes it."""
    if field == "device":
        return raw
    try:
        return float(raw)
    except ValueError:
        example = _FRACTION[1] if field == "lms_frac" else _BYTE_SETTINGS[field][3]
        raise ValueError(f"{var}={raw!r} is not a number; set it to e.g. {var}={example}, or "
                         "unset it") from None


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


@dataclasses.dataclass(frozen=True)
class LMSConfig:
    """Settings of the swap engine.

    Args:
        lms: size threshold in KB, as Caffe's ``-lms``: saved tensors smaller than this stay on
            the GPU. ``lms <= 0`` turns swapping off, so a flag can disable it.
        lms_frac: no swapping while this process's GPU use stays under ``lms_frac`` times the
            memory it may use (the device's total, or the per-process cap when one is set);
            above it, swap as little as is needed to stay under. In [0, 1]; 0 swaps every
            eligible tensor.
        prefetch_mb: the most bytes (MiB) brought back ahead of backward and not yet used.
        host_budget_gb: the most pinned host memory (GiB) this process may use; ``None`` takes
            80% of the free host memory (cgroup-aware), shared among the ranks of this node.
        device: ``"cuda"``, ``"cuda:N"``, ``"sim"`` (CPU tensors stand in for GPU ones, for tests)
            or ``None`` (the current CUDA device; without one LMS is a no-op).

    ``lms``, ``prefetch_mb`` and ``host_budget_gb`` must convert to byte counts that fit in 64
    bits (``setting_range``; NOTE [ Settings are checked as byte counts ]); anything else raises
    ValueError, as do values that are not finite.

    Example::

        cfg = LMSConfig(lms=1000, lms_frac=0.4)
        lms = lmsrt.LMS(config=cfg)
    """

    lms: float = 1000.0
    lms_frac: float = 0.75
    prefetch_mb: float = 4096.0
    host_budget_gb: Optional[float] = None
    device: Optional[str] = None

    def __post_init__(self) -> None:
        for field in ENV_VARS.values():
            object.__setattr__(self, field, _checked(field, getattr(self, field)))

    @property
    def enabled(self) -> bool:
        """Whether swapping is on at all (Caffe's convention: ``lms <= 0`` turns it off)."""
        return self.lms > 0

    @property
    def min_bytes(self) -> int:
        """The smallest storage, in bytes, that may be swapped."""
        return max(1, _to_bytes(self.lms, _BYTE_SETTINGS["lms"][0])) if self.enabled else 1

    @property
    def prefetch_bytes(self) -> int:
        return _to_bytes(self.prefetch_mb, _BYTE_SETTINGS["prefetch_mb"][0])

    @property
    def host_budget_bytes(self) -> Optional[int]:
        if self.host_budget_gb is None:
            return None
        return _to_bytes(self.host_budget_gb, _BYTE_SETTINGS["host_budget_gb"][0])

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides) -> "LMSConfig":
        """Build a config from ``LMSRT_*`` variables (see ``ENV_VARS``); unset ones keep defaults.

        Each variable is checked as its field is, and a bad one is named in the ValueError.

        Example::

            os.environ["LMSRT_LMS_FRAC"] = "0.4"
            cfg = LMSConfig.from_env()
        """
        environ = os.environ if environ is None else environ
        values: dict = {}
        for var, field in ENV_VARS.items():
            raw = environ.get(var)
            if raw is None or raw == "" or field in overrides:
                continue
            try:
                values[field] = _checked(field, _parse_env(var, field, raw), var)
            except ValueError as e:
                said = str(e)
                raise ValueError(said if said.startswith(var) else f"{var}={raw!r}: {said}"
                                 ) from None
        values.update(overrides)
        return cls(**values)
