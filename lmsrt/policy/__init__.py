"""How much lmsrt holds on the GPU, and when: the swap policy, beside the plan.

The engine (lmsrt/engine/) has the mechanism (copies, events, handles); the plan (plan.py) records
the sequence of saved storages and which of them a step offloads. The policy decides the numbers.
At every point of a step the engine asks it for three levels of GPU use (bytes allocated):

  ``swap_at(i)``   at forward point i, a storage the plan keeps is swapped anyway if use, less
                   the sources still being copied out, stands over this (0: swap everything);
  ``hold_to(i)``   sources still being copied out are let go (the compute stream waits on the
                   oldest copy) while use stands over this (0: hold at most ``overlap`` bytes);
  ``fetch_to(j)``  at backward point j, storages are fetched ahead while use plus the next one
                   stays within this (0: one storage ahead at most).

Forward point i is the i-th storage saved in the step (its index in the plan); backward point j
is the j-th unpack of the step's backward.

``FixedPolicy`` is Caffe's ``lms_frac``: one mark, ``lms_frac`` x the limit, for all three, and
the plan's target follows use at the end of forward (NOTE [ Fixed mark ]). ``AutoPolicy``
(``lms_frac="auto"``) learns the model's own use instead (NOTE [ Auto ]).
The engine asks the policy questions (``Policy``, below) and never asks which kind it is: every
number of the policy, every fraction of the limit included, lives here.

Example::

    from lmsrt.units import GiB
    policy = make_policy("auto", limit=16 * GiB, window=1 * GiB)
    level = policy.swap_at(plan, 0)        # 0 in the learning step: swap everything
"""
from __future__ import annotations

from ..options import AUTO
from .auto import AutoPolicy
from .fixed import FixedPolicy
from .profile import Profile
from .protocol import Policy

__all__ = ["Policy", "FixedPolicy", "AutoPolicy", "Profile", "make_policy"]


def make_policy(lms_frac, limit: int, window: int) -> Policy:
    """The policy for a setting of ``lms_frac``: ``options.AUTO`` or a fraction.

    Example::

        make_policy(0.4, limit=16 * GiB, window=1 * GiB).bound     # 0.4 x the limit
    """
    if lms_frac == AUTO:
        return AutoPolicy(limit, window)
    return FixedPolicy(float(lms_frac), limit, window)
