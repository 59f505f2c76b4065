import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

# MPI spawn looks for mpiexec on PATH; the mpich wheel puts it next to the interpreter.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

_EXIT_GRACE_S = 60.0


def pytest_sessionfinish(session, exitstatus):
    session.config._openengine_exitstatus = int(exitstatus)


def pytest_unconfigure(config):
    """A guard for CI: if the interpreter has not exited a minute after the run (a stray non-daemon thread),
    dump every thread's stack for diagnosis and exit with the run's own status instead of hanging."""
    import faulthandler
    import threading

    status = getattr(config, "_openengine_exitstatus", None)
    if status is None:
        return

    def guard():
        import time

        time.sleep(_EXIT_GRACE_S)
        print(f"\ntests finished but the interpreter did not exit within {_EXIT_GRACE_S:.0f} s; "
              "thread stacks follow", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(status)

    threading.Thread(target=guard, daemon=True, name="exit-guard").start()
