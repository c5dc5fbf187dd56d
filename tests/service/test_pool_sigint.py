"""A Ctrl-C while the grader pool starts prints nothing from the pool's fork server or workers.

The fork server imports the warm-up (math-verify, sympy, ANTLR tables: seconds) before it guards
itself against SIGINT; a terminal's Ctrl-C reaches the whole process group, so without the pool's
guard each SIGINT in that window printed a traceback from inside the warm-up. Here SIGINT is sent
to the process group four times while the pool starts (the parent records what reaches it and
carries on): no traceback, the pool still grades, and the parent's own SIGINT handler is in place after.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading
    from stapo.verifier_service.server.pool import GraderPool

    if __name__ == "__main__":
        got = []
        signal.signal(signal.SIGINT, lambda s, f: got.append(s))
        for delay in (0.5, 1.5, 2.5, 3.5):
            threading.Timer(delay, os.killpg, (0, signal.SIGINT)).start()
        pool = GraderPool(workers=1, deadline_s=20.0)
        try:
            result = pool.grade("the answer is \\\\boxed{7}", "7")
        finally:
            pool.close()
        # while its fork server starts the parent ignores SIGINT too (the server inherits that), so how
        # many of the four land is timing; once the pool runs, the parent's own handler is back
        n = len(got)
        os.kill(os.getpid(), signal.SIGINT)
        print("handler", len(got) > n, "correct", result.correct)
    """
)


def test_ctrl_c_during_pool_start_prints_no_traceback(tmp_path):
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          start_new_session=True)  # its own process group: the SIGINTs stay inside it
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.split() == ["handler", "True", "correct", "True"], proc.stdout
