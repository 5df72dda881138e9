"""Click parameter types whose error messages say what to give instead, and the LMS settings as
click options, made from the table in ``lmsrt.options``."""
from __future__ import annotations

import math
import re
from typing import Callable, Dict, Optional, Sequence

import click

from ..options import OPTIONS, Option, check, setting_range

__all__ = ["Number", "Choice", "Checked", "setting_options", "settings_given"]


class Number(click.ParamType):
    """A finite float within bounds, or one of ``words``; its error message says what to give
    instead."""

    name = "number"

    def __init__(self, low: Optional[float] = None, high: Optional[float] = None,
                 low_open: bool = False, example: str = "", words: Sequence[str] = ()):
        self.low, self.high, self.low_open, self.example = low, high, low_open, example
        self.words = tuple(words)

    @classmethod
    def setting(cls, option: Option) -> "Number":
        """The values the LMS setting ``option`` accepts (``lmsrt.options.setting_range``)."""
        low, high = setting_range(option.name)
        return cls(low, high, example=f"give {option.give}, e.g. {option.flag} {option.example}",
                   words=option.words)

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value in self.words:
            return value
        try:
            x = float(value)
        except (TypeError, ValueError):
            words = "".join(f" or {w}" for w in self.words)
            self.fail(f"{value!r} is not a number{words}; {self.example}", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value} is not a finite number; {self.example}", param, ctx)
        too_low = self.low is not None and (x <= self.low if self.low_open else x < self.low)
        too_high = self.high is not None and x > self.high
        if too_low or too_high:
            self.fail(f"{value} is not {self._range()}; {self.example}", param, ctx)
        return x

    def _range(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:.6g}, {self.high:.6g}]"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:.6g}"
        return f"<= {self.high:.6g}"


class Choice(click.ParamType):
    """A string matching ``pattern``, whose error message says what to give instead."""

    name = "text"

    def __init__(self, pattern: str, example: str, check: Optional[Callable] = None):
        self.pattern, self.example, self.check = re.compile(pattern), example, check

    def convert(self, value, param, ctx) -> str:
        value = str(value)
        if not self.pattern.fullmatch(value):
            self.fail(f"{value!r} is not {self.example}", param, ctx)
        why_not = self.check(value) if self.check else None
        if why_not:
            self.fail(why_not, param, ctx)
        return value


class Checked(click.ParamType):
    """The value of a setting with a check of its own: on or off (or true/false, 1/0, yes/no),
    or one of its words."""

    name = "text"

    def __init__(self, option: Option):
        self.option = option

    def convert(self, value, param, ctx):
        try:
            return check(self.option.name, value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not {self.option.what}; give e.g. {self.option.flag} "
                      f"{self.option.example}", param, ctx)


def setting_options(f: Callable) -> Callable:
    """Decorate a click command with one option per LMS setting that has a flag, each passed to
    it as the setting's name (None when not given)."""
    for option in reversed([o for o in OPTIONS.values() if o.flag]):
        kind = Checked(option) if option.check is not None else Number.setting(option)
        f = click.option(option.flag, option.name, type=kind,
                         metavar=option.metavar, default=None,
                         help=f"{option.help} [{option.env}]")(f)
    return f


def settings_given(values: Dict[str, object]) -> Dict[str, object]:
    """The LMS settings among a command's ``values`` that were given, by name."""
    return {name: values[name] for name in OPTIONS if values.get(name) is not None}
