"""The engine's messages (`lmsrt.diagnostics`): each one-time warning once, and an out-of-memory
error that names settings as the option table spells them. The engine's own tests
(test_reliability.py) check that these reach the user."""

import pytest
import torch
from models import lmsrt_warnings

from lmsrt.config import LMSConfig
from lmsrt.diagnostics import Diagnostics
from lmsrt.options import spelled
from lmsrt.policy import make_policy
from lmsrt.stats import StepStats
from lmsrt.units import GiB


def _oom_text(lms_frac, host_refused=0, lms=4096.0) -> str:
    exc = torch.OutOfMemoryError("CUDA out of memory.")
    Diagnostics().annotate_oom(
        exc, "in forward", config=LMSConfig(lms=lms, lms_frac=lms_frac),
        policy=make_policy(lms_frac, 16 * GiB, 4 * GiB), step=StepStats(step=3),
        allocated=15 * GiB, peak=16 * GiB, limit=16 * GiB, largest=(GiB, 11),
        host_refused=host_refused)
    return str(exc)


@pytest.mark.parametrize("lms_frac", [0.5, "auto"])
def test_oom_hints_spell_settings_as_the_option_table_does(lms_frac):
    text = _oom_text(lms_frac, host_refused=2)
    assert text.startswith("CUDA out of memory.\nlmsrt: out of GPU memory with LMS on, in forward")
    assert "saved 12th in forward" in text
    assert f"({spelled('host_budget_gb')})" in text
    assert f"({spelled('lms')}, now 4096 KiB)" in text
    if lms_frac == "auto":
        assert f"({spelled('lms_frac', 0.5)}, say)" in text
    else:
        assert f"({spelled('lms_frac')}, now 0.5)" in text


def test_an_error_is_annotated_once():
    exc = torch.OutOfMemoryError("CUDA out of memory.")
    diagnostics = Diagnostics()
    for _ in range(2):
        diagnostics.annotate_oom(
            exc, "in forward", config=LMSConfig(lms_frac=0.75), policy=make_policy(0.75, GiB, GiB),
            step=StepStats(), allocated=0, peak=0, limit=GiB, largest=(0, 0), host_refused=0)
    assert str(exc).count("lmsrt: out of GPU memory") == 1


def test_each_warning_is_given_once():
    diagnostics = Diagnostics()
    with lmsrt_warnings() as said:
        for _ in range(3):
            diagnostics.alloc_retries(StepStats(step=2, alloc_retries=2))
            diagnostics.copy_out_failed(1 << 20, RuntimeError("injected"))
            diagnostics.unswappable(torch.nn.Parameter(torch.zeros(1)))
    assert len(said) == 3 and diagnostics.given == {"retries", "d2h", "kind"}, said
    assert "ran out of room 2 times" in said[0] and "injected" in said[1] and "Parameter" in said[2]
