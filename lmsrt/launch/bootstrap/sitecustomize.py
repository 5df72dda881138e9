"""lmsrt's bootstrap for the worker processes of ``lmsrt run --nproc-per-node N ...``.

Python imports the first ``sitecustomize`` module on sys.path while it starts up. ``lmsrt run``
puts this directory first on PYTHONPATH and hands over to torch.distributed.run, so every worker
it starts runs this file before the training script: it enables LMS on the worker's main thread
(``lmsrt.launch.session.start``, settings from ``LMSRT_*`` variables, device
``cuda:LOCAL_RANK``), makes the stats and summary be written at exit, and then runs the
``sitecustomize`` that would have run without lmsrt, if there is one.

Every Python process that inherits the environment imports this file too: the torchrun agent
(which has the launcher's pid, ``LMSRT_LAUNCHER_PID``) and whatever a worker starts (data loader
or compiler subprocesses, which inherit ``LMSRT_ACTIVE=1`` from the worker). Those only chain.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _should_start(environ, pid: int) -> bool:
    return (environ.get("LMSRT_BOOTSTRAP") == "1" and environ.get("LMSRT_ACTIVE") != "1"
            and environ.get("LMSRT_LAUNCHER_PID") != str(pid))


def _start_lms() -> None:
    try:
        import lmsrt.launch.session as launch
    except ImportError:
        # lmsrt is imported from a source tree the worker's sys.path does not hold yet (sys.path[0]
        # is set after this file runs): import it from where this file lives, and only that.
        root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
        sys.path.insert(0, root)
        try:
            import lmsrt.launch.session as launch
        finally:
            sys.path.remove(root)
    import atexit

    try:
        session = launch.start()
    except Exception as e:  # noqa: BLE001 - said, then the script stops
        # Training on without the LMS the user asked for would fail later and less clearly.
        rank = os.environ.get("RANK", "?")
        print(f"lmsrt: could not enable LMS in worker rank {rank}: {type(e).__name__}: {e}. "
              "Check the LMSRT_* settings (lmsrt info shows them), or run the script without "
              "lmsrt run.", file=sys.stderr, flush=True)
        os._exit(2)
    atexit.register(session.finish)


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path, which Python would have run instead of this."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    # `import sitecustomize` elsewhere should find the user's module, as it would without lmsrt.
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if _should_start(os.environ, os.getpid()):
    _start_lms()
_chain()
