"""``lmsrt info``: what lmsrt finds on this machine, and what is missing.

Versions (lmsrt, torch, CUDA runtime, NVIDIA driver), the GPUs and their free memory, host memory
and the pinned budget lmsrt would use per local rank, whether the native allocator and the C++
copy path are in use, the ``LMSRT_*`` settings in the environment, whether the C++ compiler
and ninja that the copy path's first-use build needs are there, and with ``--bandwidth`` the
pinned copy speed. On a CUDA GPU where the copy path is not built yet, asking for it builds it
(lmsrt/copy_path.py, NOTE [ Building on first use ]), as the first LMS would.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sysconfig
from typing import Dict, List, Optional

import click

from ..options import OPTIONS, spelled
from ..units import GiB, MiB

__all__ = ["command", "collect", "INFO_SCHEMA"]

# The layout of `lmsrt info --json`; raised when a field changes meaning or goes.
INFO_SCHEMA = 1

def _driver_version() -> str:
    try:
        import pynvml  # from nvidia-ml-py; imported here, as it is needed only here
    except ImportError as e:
        return f"unavailable (pynvml: {e}; pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:   # noqa: BLE001 - NVMLError_LibraryNotFound, ..._DriverNotLoaded, ...
        return f"unavailable ({e})"
    return version.decode() if isinstance(version, bytes) else str(version)


def _no_gpu_reason(torch) -> str:
    if torch.version.cuda is None:
        return (f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch to "
                f"swap on a GPU ({spelled('device', 'sim')} runs lmsrt on a simulated one for "
                "tests)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return (f"torch sees no CUDA device{hint}; check nvidia-smi and the NVIDIA driver, or "
            "CUDA_VISIBLE_DEVICES")


def _gpus(torch) -> List[Dict[str, object]]:
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        gpus.append({"index": i, "name": props.name, "capability": f"sm_{props.major}{props.minor}",
                     "total_bytes": total, "free_bytes": free})
    return gpus


def _build_tools() -> Dict[str, Optional[str]]:
    """Where the C++ compiler (the one torch.utils.cpp_extension builds with: $CXX, else c++, cl
    on Windows) and ninja are, None for each that is not found. pip's ninja, beside this Python,
    counts: the build looks there too."""
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()
    path = os.pathsep.join(p for p in (os.environ.get("PATH"), sysconfig.get_path("scripts"))
                           if p)
    return {"cxx_name": compiler, "cxx": shutil.which(compiler),
            "ninja": shutil.which("ninja", path=path)}


def _host() -> Dict[str, object]:
    import psutil

    from ..host_memory import cgroup_available, host_budget

    vm = psutil.virtual_memory()
    return {"total_bytes": vm.total, "available_bytes": vm.available,
            "cgroup_available_bytes": cgroup_available(),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1),
            "pinned_budget_bytes": host_budget(),
            "pinned_budget_setting": os.environ.get(OPTIONS["host_budget_gb"].env) or None}


def _bandwidth(nbytes: int = 256 * MiB, reps: int = 5) -> Dict[str, float]:
    """Pinned host <-> GPU copy speed in GB/s, the median of ``reps`` timed copies each way."""
    from ..device import copy_bandwidth
    speeds = copy_bandwidth(0, nbytes, reps)
    return {"bytes": nbytes, "reps": reps, "h2d_gbps": speeds["h2d"] / 1e9,
            "d2h_gbps": speeds["d2h"] / 1e9}


def collect(bandwidth: bool = False) -> Dict[str, object]:
    """Everything ``lmsrt info`` shows, as a dict (what ``--json`` prints).

    Example::

        from lmsrt._cli.info import collect
        print(collect()["allocator"])
    """
    import torch

    from .. import __version__, arena, copy_path
    from ..config import ENV_VARS
    from ..launch.session import ENV_GPU_LIMIT, ENV_MAX_STEPS, ENV_STATS

    cuda = torch.cuda.is_available()
    data: Dict[str, object] = {
        "lmsrt_version": __version__,
        "schema": INFO_SCHEMA,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nvidia_driver": _driver_version(),
        "gpus": _gpus(torch) if cuda else [],
        "no_gpu_reason": None if cuda else _no_gpu_reason(torch),
        "host": _host(),
        "native_allocator": arena.NATIVE,
        "allocator": arena.native_status(),
        "copy_path": copy_path.status(),
        "cache": _cache(),
        "build_tools": _build_tools(),
        "settings": {k: v for k, v in os.environ.items()
                     if k in ENV_VARS or k in (ENV_GPU_LIMIT, ENV_STATS, ENV_MAX_STEPS)},
        "bandwidth": None,
    }
    if bandwidth:
        data["bandwidth"] = _bandwidth() if cuda else {"skipped": "no CUDA GPU"}
    return data


def _cache() -> Dict[str, object]:
    """Where lmsrt keeps builds and pin records, and why it would not use them ('' if it
    would; lmsrt/cache.py, NOTE [ Trusting the cache ])."""
    from ..cache import cache_root, unsafe

    root = cache_root()
    return {"path": root, "refused": unsafe(root) if os.path.lexists(root) else ""}


def _gib(n: Optional[float]) -> str:
    return "none" if n is None else f"{n / GiB:.2f} GiB"


def format_info(data: Dict[str, object]) -> str:
    """The text ``lmsrt info`` prints."""
    row = "  {:<20} {}".format
    tools = data["build_tools"]
    lines = [f"lmsrt {data['lmsrt_version']}",
             row("python", data["python"]),
             row("torch", data["torch"]),
             row("CUDA runtime", data["cuda_runtime"] or "none (CPU-only build of torch)"),
             row("cuDNN", data["cudnn"] or "none"),
             row("NVIDIA driver", data["nvidia_driver"]),
             row("allocator", data["allocator"]),
             row("copy path", data["copy_path"]),
             row("cache", data["cache"]["path"] + (f" (not used: {data['cache']['refused']})"
                                                   if data["cache"]["refused"] else "")),
             row("C++ compiler", tools["cxx"] or f"none: {tools['cxx_name']} is not on PATH; the "
                 "copy path's first-use build needs one (install g++ or clang, or set CXX)"),
             row("ninja", tools["ninja"] or "none: the copy path's first-use build needs it "
                 "(pip install ninja)"),
             "GPUs"]
    if not data["gpus"]:
        lines.append(row("none", data["no_gpu_reason"]))
    for g in data["gpus"]:
        lines.append(row(f"[{g['index']}] {g['capability']}",
                         f"{g['name']}: {_gib(g['total_bytes'])} total, "
                         f"{_gib(g['free_bytes'])} free"))
    host = data["host"]
    cgroup = host["cgroup_available_bytes"]
    budget = (f"{host['pinned_budget_setting']} GiB ({OPTIONS['host_budget_gb'].env})"
              if host["pinned_budget_setting"] is not None else
              f"{_gib(host['pinned_budget_bytes'])} per local rank (80% of what is available"
              f"{' under the cgroup limit' if cgroup is not None else ''}, shared by "
              f"LOCAL_WORLD_SIZE={host['local_world_size']} ranks)")
    lines += ["host memory",
              row("total", _gib(host["total_bytes"])),
              row("available", _gib(host["available_bytes"])),
              row("cgroup limit", "none" if cgroup is None else f"{_gib(cgroup)} left under it"),
              row("pinned budget", budget),
              "settings"]
    settings = data["settings"]
    lines += [row(k, v) for k, v in sorted(settings.items())] or [row("LMSRT_*", "none set")]
    bw = data["bandwidth"]
    if bw is not None:
        lines.append("bandwidth")
        if "skipped" in bw:
            lines.append(row("pinned copies", f"skipped: {bw['skipped']}"))
        else:
            lines.append(row("pinned copies", f"H2D {bw['h2d_gbps']:.1f} GB/s, D2H "
                             f"{bw['d2h_gbps']:.1f} GB/s ({bw['bytes'] >> 20} MiB, median of "
                             f"{bw['reps']})"))
    return "\n".join(lines)


@click.command("info")
@click.option("--bandwidth", is_flag=True, help="Also measure pinned H2D/D2H copy speed (256 MiB).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def command(bandwidth: bool, as_json: bool) -> None:
    """Show versions, GPUs, host memory and pinned budget, and the allocator lmsrt uses.

    \b
    Examples:
      lmsrt info
      lmsrt info --bandwidth
      lmsrt info --json > info.json
    """
    data = collect(bandwidth)
    click.echo(json.dumps(data, indent=1) if as_json else format_info(data))
