"""`LMSConfig`: settings checked by the byte counts they convert to, from Python and LMSRT_*."""
import math

import pytest

import lmsrt
from lmsrt.config import MAX_BYTES, LMSConfig, setting_range

BYTE_COUNTS = {"lms": "min_bytes", "prefetch_mb": "prefetch_bytes",
               "host_budget_gb": "host_budget_bytes"}


@pytest.mark.parametrize("setting, value, message", [
    ("lms", 1e306, "lms must be in [-9.0072e+15, 9.0072e+15] KiB (its byte count must fit in 64 "
                   "bits), got 1e+306; give e.g. lms=1000"),
    pytest.param("lms", 10**400, "lms must be in [-9.0072e+15, 9.0072e+15] KiB",   # beyond floats
                 id="lms-10**400"),
    pytest.param("lms", -10**400, "got -10000000000... (401 digits)", id="lms--10**400"),
    ("lms", -1e308, "lms must be in [-9.0072e+15"),
    ("prefetch_mb", 1e308, "prefetch_mb must be in [0, 8.79609e+12] MiB"),
    ("host_budget_gb", 1e300, "host_budget_gb must be in [0, 8.58993e+09] GiB"),
    ("host_budget_gb", math.inf, "host_budget_gb must be finite (GiB, >= 0, or None for 80% of "
                                 "the free host memory), got inf; give e.g. host_budget_gb=64"),
    ("lms_frac", math.nan, "lms_frac must be finite (in [0, 1]), got nan; give e.g. "
                           "lms_frac=0.75"),
    ("lms_frac", 1.5, "lms_frac must be in [0, 1], got 1.5"),
])
def test_settings_out_of_range_raise_value_error(setting, value, message):
    with pytest.raises(ValueError) as info:
        lmsrt.LMS(device="sim", **{setting: value})
    assert message in str(info.value)


@pytest.mark.parametrize("setting", sorted(BYTE_COUNTS))
def test_the_range_ends_where_the_byte_count_stops_fitting(setting):
    low, high = setting_range(setting)
    at_most = LMSConfig(**{setting: high})
    assert 0 < getattr(at_most, BYTE_COUNTS[setting]) <= MAX_BYTES
    with pytest.raises(ValueError, match="its byte count must fit in 64 bits"):
        LMSConfig(**{setting: math.nextafter(high, math.inf)})
    LMSConfig(**{setting: low})
    with pytest.raises(ValueError, match=r"must be (in \[|>= 0)"):
        LMSConfig(**{setting: math.nextafter(low, -math.inf)})


def test_swapping_off_at_any_negative_lms():
    config = LMSConfig(lms=-1e15)
    assert not config.enabled and config.min_bytes == 1


@pytest.mark.parametrize("var, raw, message", [
    ("LMSRT_LMS", "1e306", "LMSRT_LMS must be in [-9.0072e+15, 9.0072e+15] KiB (its byte count "
                           "must fit in 64 bits), got 1e+306; set it to e.g. LMSRT_LMS=1000, or "
                           "unset it"),
    ("LMSRT_LMS", "inf", "LMSRT_LMS must be finite (KiB; <= 0 turns swapping off), got inf"),
    ("LMSRT_PREFETCH_MB", "1e308", "LMSRT_PREFETCH_MB must be in [0, 8.79609e+12] MiB"),
    ("LMSRT_HOST_BUDGET_GB", "1e300", "set it to e.g. LMSRT_HOST_BUDGET_GB=64, or unset it"),
    ("LMSRT_LMS_FRAC", "nan", "LMSRT_LMS_FRAC must be finite (in [0, 1]), got nan"),
    ("LMSRT_PREFETCH_MB", "lots", "LMSRT_PREFETCH_MB='lots' is not a number; set it to e.g. "
                                  "LMSRT_PREFETCH_MB=4096, or unset it"),
    ("LMSRT_DEVICE", "gpu", "LMSRT_DEVICE='gpu': device must be 'cuda', 'cuda:N'"),
])
def test_environment_settings_are_checked_and_named(var, raw, message):
    with pytest.raises(ValueError) as info:
        LMSConfig.from_env({var: raw})
    assert message in str(info.value)


def test_an_argument_replaces_its_environment_variable_unread():
    assert LMSConfig.from_env({"LMSRT_LMS": "1e306"}, lms=5).lms == 5
