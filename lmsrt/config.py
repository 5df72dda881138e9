"""Frozen configuration of an LMS instance, and how to read it from the environment.

Its fields, their checks and their variables come from the table in ``lmsrt.options``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from .options import (
    MAX_BYTES,
    OPTIONS,
    byte_count,
    check,
    cuda_index,
    describe,
    parse_env,
    setting_range,
)

__all__ = ["LMSConfig", "ENV_VARS", "MAX_BYTES", "cuda_index", "setting_range"]

# Environment variable -> LMSConfig field, read by LMSConfig.from_env() and set by `lmsrt run`.
ENV_VARS = {option.env: option.name for option in OPTIONS.values()}


def _fields_from_table(cls: type) -> type:
    """Give ``cls`` one annotated field, with its default, per setting of ``OPTIONS``, for
    ``dataclasses.dataclass`` to make the fields of."""
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    for option in OPTIONS.values():
        annotations[option.name] = option.type
        setattr(cls, option.name, option.default)
    cls.__annotations__ = annotations
    return cls


@dataclasses.dataclass(frozen=True)
@_fields_from_table
class LMSConfig:
    """Settings of the swap engine: one field per setting of ``lmsrt.options.OPTIONS``.

    Args:
<settings>

    ``lms``, ``prefetch_mb`` and ``host_budget_gb`` must convert to byte counts that fit in 64
    bits (``setting_range``; NOTE [ Settings are checked as byte counts ]); anything else raises
    ValueError, as do values that are not finite.

    Example::

        cfg = LMSConfig(lms=1000, lms_frac=0.4)
        lms = lmsrt.LMS(config=cfg)
    """

    def __post_init__(self) -> None:
        for name in OPTIONS:
            object.__setattr__(self, name, check(name, getattr(self, name)))

    @property
    def enabled(self) -> bool:
        """Whether swapping is on at all (Caffe's convention: ``lms <= 0`` turns it off)."""
        return self.lms > 0

    @property
    def min_bytes(self) -> int:
        """The smallest storage, in bytes, that may be swapped."""
        return max(1, byte_count("lms", self.lms)) if self.enabled else 1

    @property
    def prefetch_bytes(self) -> int:
        return byte_count("prefetch_mb", self.prefetch_mb)

    @property
    def host_budget_bytes(self) -> Optional[int]:
        if self.host_budget_gb is None:
            return None
        return byte_count("host_budget_gb", self.host_budget_gb)

    def as_dict(self) -> dict:
        """Every setting by name (what ``LMS.stats()["config"]`` shows)."""
        return {name: getattr(self, name) for name in OPTIONS}

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
        for name, option in OPTIONS.items():
            raw = environ.get(option.env)
            if raw is None or raw == "" or name in overrides:
                continue
            try:
                values[name] = check(name, parse_env(name, raw), option.env)
            except ValueError as e:
                said = str(e)
                raise ValueError(said if said.startswith(option.env) else
                                 f"{option.env}={raw!r}: {said}") from None
        values.update(overrides)
        return cls(**values)


LMSConfig.__doc__ = LMSConfig.__doc__.replace("<settings>", describe(indent=8))
