"""`lmsrt run` on a training loop, interrupted by one SIGINT, RUNS times (tests/test_integrity.py).

    PYTHONPATH=. python tests/scripts/sigint_runs.py SCRIPT RUNS

Each run is a child forked after torch and lmsrt are imported (a fresh interpreter costs seconds
on a small machine), so each starts `lmsrt run SCRIPT` as the command line would. The signal
lands at a different point of the step each time. Prints each run's exit status, one a line.
"""
import os
import signal
import sys
import time

from lmsrt._cli import main  # imports torch too: once, before forking

script, runs = sys.argv[1], int(sys.argv[2])
for i in range(runs):
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.dup2(ready_w, 3)
        code = 1
        try:
            main.main(["run", script], prog_name="lmsrt", standalone_mode=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(ready_w)
    assert os.read(ready_r, 5) == b"ready"
    os.close(ready_r)
    time.sleep(0.002 * (i % 10))             # land in different places of the step
    os.kill(pid, signal.SIGINT)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
