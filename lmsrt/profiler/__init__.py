"""Where the GPU memory of a training step goes: ``lmsrt.memory_report`` and ``lmsrt profile``.

``recorder.py`` measures one step, module by module (hooks only, no LMS); ``report.py`` turns
what it measured into a ``MemoryReport`` with a predicted peak and a verdict; ``render.py`` shows
a report as text, a PNG timeline and an HTML page. The package uses the runtime core (device.py,
options.py, units.py); the core does not import it.

Example::

    report = lmsrt.memory_report(model, x, optimizer=opt, gpu_size=8)
    print(report)
"""
from .recorder import StepDone, StepRecorder
from .report import MemoryReport, build_report, memory_report

__all__ = ["MemoryReport", "StepDone", "StepRecorder", "build_report", "memory_report"]
