"""Frozen configuration of an LMS instance, and how to read it from the environment."""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Mapping, Optional

__all__ = ["LMSConfig", "ENV_VARS", "cuda_index"]

# Environment variable -> LMSConfig field, read by LMSConfig.from_env() and set by `lmsrt run`.
ENV_VARS = {
    "LMSRT_LMS": "lms",
    "LMSRT_LMS_FRAC": "lms_frac",
    "LMSRT_PREFETCH_MB": "prefetch_mb",
    "LMSRT_HOST_BUDGET_GB": "host_budget_gb",
    "LMSRT_DEVICE": "device",
}


def _number(name: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number ({allowed}), got {type(value).__name__} "
                        f"{value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite ({allowed}), got {value!r}")
    return float(value)


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
        object.__setattr__(self, "lms", _number("lms", self.lms, "KB; <= 0 turns swapping off"))
        frac = _number("lms_frac", self.lms_frac, "in [0, 1]")
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"lms_frac must be in [0, 1], got {frac!r}")
        object.__setattr__(self, "lms_frac", frac)
        prefetch = _number("prefetch_mb", self.prefetch_mb, "MiB, >= 0")
        if prefetch < 0:
            raise ValueError(f"prefetch_mb must be >= 0 MiB, got {prefetch!r}")
        object.__setattr__(self, "prefetch_mb", prefetch)
        if self.host_budget_gb is not None:
            budget = _number("host_budget_gb", self.host_budget_gb, "GiB, >= 0, or None for auto")
            if budget < 0:
                raise ValueError(f"host_budget_gb must be >= 0 GiB or None, got {budget!r}")
            object.__setattr__(self, "host_budget_gb", budget)
        if self.device is not None and not isinstance(self.device, str):
            raise TypeError(f"device must be None or a string: 'cuda', 'cuda:N' or 'sim', got "
                            f"{type(self.device).__name__} {self.device!r}")
        cuda_index(self.device)

    @property
    def enabled(self) -> bool:
        """Whether swapping is on at all (Caffe's convention: ``lms <= 0`` turns it off)."""
        return self.lms > 0

    @property
    def min_bytes(self) -> int:
        """The smallest storage, in bytes, that may be swapped."""
        return max(1, int(self.lms * 1024))

    @property
    def prefetch_bytes(self) -> int:
        return int(self.prefetch_mb * 2**20)

    @property
    def host_budget_bytes(self) -> Optional[int]:
        return None if self.host_budget_gb is None else int(self.host_budget_gb * 2**30)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides) -> "LMSConfig":
        """Build a config from ``LMSRT_*`` variables (see ``ENV_VARS``); unset ones keep defaults.

        Example::

            os.environ["LMSRT_LMS_FRAC"] = "0.4"
            cfg = LMSConfig.from_env()
        """
        environ = os.environ if environ is None else environ
        values: dict = {}
        for var, field in ENV_VARS.items():
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            if field == "device":
                values[field] = raw
                continue
            try:
                values[field] = float(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a number; set it to e.g. "
                                 f"{var}={getattr(cls, field, 0) or 1}") from None
        values.update(overrides)
        return cls(**values)
