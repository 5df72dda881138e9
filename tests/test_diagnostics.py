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
from lmsrt.units import GiB, MiB, format_bytes


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


def _oom_at_most(where, message, stepped=True, largest=3 * GiB) -> str:
    """The text of an out-of-memory error raised ``where`` with swapping at its most."""
    exc = torch.OutOfMemoryError(message)
    Diagnostics().annotate_oom(
        exc, where, config=LMSConfig(lms=1, lms_frac=0.0), policy=make_policy(0.0, 10 * GiB, 0),
        step=StepStats(step=1), allocated=7 * GiB, peak=8 * GiB, limit=10 * GiB,
        largest=(largest, 316), host_refused=0, optimizer_stepped=stepped)
    return str(exc)


def test_an_oom_in_backward_as_large_as_the_largest_saved_storage_names_its_floor():
    """A GPT-2 script at 10 GiB: backward asked 3.07 GiB, the size of its float32 log-probabilities
    (the largest saved storage); their backward holds three of that at once."""
    asked = "CUDA out of memory. Tried to allocate 3.07 GiB. GPU 0 has a total capacity of 139 GiB"
    text = _oom_at_most("in backward", asked, largest=int(3.07 * GiB))
    assert "Backward asked for 3.07 GiB at once" in text and "about 9.21 GiB" in text
    assert "in chunks" in text
    for where, message, largest in (("in forward", asked, int(3.07 * GiB)),
                                    ("in backward", asked, 8 * GiB),
                                    ("in backward", "CUDA out of memory.", int(3.07 * GiB))):
        assert "Backward asked" not in _oom_at_most(where, message, largest=largest)


def test_an_oom_before_any_optimizer_step_does_not_advise_moving_optimizer_state():
    before = _oom_at_most("in backward", "CUDA out of memory.", stepped=False)
    after = _oom_at_most("in backward", "CUDA out of memory.", stepped=True)
    assert "no optimizer has stepped under lmsrt yet" in before
    assert spelled("optimizer_state", "host") not in before
    assert spelled("optimizer_state", "host") in after


def test_the_backward_floor_is_named_only_where_backward_asked_about_the_largest_storage():
    """torch says the size asked for as its allocator formats it ("20.00 MiB", "1.50 GiB",
    "512 bytes"): the floor's text where that is about the largest saved storage, not where
    backward asked for far more than it (that is no gradient of the op that saved it)."""
    for asked, largest in (("20.00 MiB", 20 * MiB), ("1.50 GiB", 3 * GiB // 2),
                           ("512 bytes", 512)):
        text = _oom_at_most("in backward", f"CUDA out of memory. Tried to allocate {asked}. GPU 0",
                            largest=largest)
        assert f"Backward asked for {format_bytes(largest)} at once" in text, (asked, text)
    much_more = "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of"
    assert "Backward asked" not in _oom_at_most("in backward", much_more, largest=GiB)
