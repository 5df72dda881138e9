"""What the tests that start processes share: the source tree, a child's environment, files."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]     # the source tree: lmsrt/, examples/, tests/


def clean_env(**extra: str) -> dict:
    """The environment of a child: this one without LMSRT_*/torchrun variables, LMS on `sim`,
    pinning nothing ahead."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMSRT_") and k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["LMSRT_DEVICE"] = "sim"
    env["LMSRT_PIN_AHEAD"] = "off"     # no records of pinned memory (lmsrt/cache.py) left behind
    env.update(extra)
    return env


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)
