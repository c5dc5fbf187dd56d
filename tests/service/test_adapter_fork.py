"""The adapters across fork and pickle, as verl's legacy ``prime`` manager uses them, and their limits.

That manager (``verl/workers/reward_manager/prime.py``, 0.6.x) submits
``partial(fn, task, completion, reference, extra_info)`` to a ``ProcessPoolExecutor`` whose workers
are forked from the trainer; since verl 0.7 the function comes from ``load_extern_object``, which
loads the file under ``custom_module_<hash>`` without registering it in ``sys.modules``. The service
is a real uvicorn on 127.0.0.1 (``server`` fixture); grading is real.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import pytest

from stapo.verifier_service.clients import adapters


def load_like_verl_07(name: str = "custom_module_4242"):
    """verl >= 0.7 ``load_extern_object(path, name)``: a module from the file, not in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(name, adapters.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def call_with_kwargs(raw_fn, extra_kwargs, *args, **kwargs):
    """verl's ``_call_with_kwargs``: reward_kwargs bound to the loaded function by a partial."""
    return raw_fn(*args, **{**kwargs, **extra_kwargs})


# Known rewards: fractions, roots, tuples, an end-of-turn token, an integer gold, wrong answers.
CASES = [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so \\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("so \\boxed{(1, 2)}", "(1,2)", 1.0),
    ("so \\boxed{7}<|im_end|>", "7", 1.0),
    ("so \\boxed{12}", 12, 1.0),
    ("so \\boxed{5}", "4", 0.0),
    ("so \\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("no answer here", "4", 0.0),
]


@pytest.fixture
def via_service(server, monkeypatch):
    adapters.close_verifiers()
    monkeypatch.setenv("STAPO_VERIFIER_URL", server.url)
    monkeypatch.delenv("STAPO_VERIFIER_FAILURE_SCORE", raising=False)
    yield server
    adapters.close_verifiers()


def test_children_forked_after_a_first_call_grade_right(via_service):
    """The parent's client holds a keep-alive connection when the pool forks; every child must open its own.

    Sharing it, children's requests interleave on one socket and the service answers 422/400, or a
    child reads another's answer: the rewards below would then be wrong or the calls would raise.
    """
    fn = load_like_verl_07().compute_score_prime
    bound = partial(call_with_kwargs, fn, {})
    ctx = multiprocessing.get_context("fork")
    cases = CASES * 3  # 24 calls from 4 processes at once, per round
    for _ in range(3):  # a shared socket does not corrupt every time: three rounds make a miss unlikely
        # the parent's call just before the fork leaves an idle keep-alive connection in its client
        assert fn("warm", "so \\boxed{4}", "4", None) == (1.0, "ok")
        parent_client = adapters.get_verifier()
        start_together = ctx.Barrier(4)  # the workers' first requests go out at the same moment
        with ProcessPoolExecutor(max_workers=4, mp_context=ctx, initializer=start_together.wait) as ex:
            futures = [ex.submit(partial(bound, "math", pred, gold, None)) for pred, gold, _ in cases]
            got = [f.result(timeout=120) for f in futures]
        assert [score for score, _ in got] == [want for _, _, want in cases]
        assert {status for _, status in got} <= {"ok", "no_answer"}

    # the parent's client still works after its children used theirs
    assert adapters.get_verifier() is parent_client
    assert fn("again", "so \\boxed{\\frac{1}{2}}", "1/2", None) == (1.0, "ok")


def test_a_forked_child_starts_with_its_own_client(via_service):
    adapters.compute_score("x", "so \\boxed{4}", "4")
    parent_id = id(adapters.get_verifier())
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        child_fresh = ex.submit(_verifier_count).result(timeout=60)
    assert child_fresh == 0, "a forked child inherited the parent's verifiers"
    assert id(adapters.get_verifier()) == parent_id


def _verifier_count() -> int:
    return len(adapters._VERIFIERS)  # our own module's state, read in the child


def test_functions_loaded_by_file_path_pickle_by_reference():
    """verl >= 0.7 loads the file under a name that is not importable; pickling must still work."""
    mod = load_like_verl_07("custom_module_-77")
    for name in ("compute_score", "compute_score_batch", "compute_score_prime", "reward_func"):
        fn = getattr(mod, name)
        back = pickle.loads(pickle.dumps(partial(call_with_kwargs, fn, {"failure_score": 0.0})))
        assert back.args[0] is getattr(adapters, name), name
    assert mod.get_verifier is adapters.get_verifier  # one verifier per process, file or package


def test_prime_route_in_process_honours_the_size_limits(monkeypatch):
    """Graded in-process (no URL), the prime route applies the same limits as the pool and the service."""
    adapters.close_verifiers()
    monkeypatch.delenv("STAPO_VERIFIER_URL", raising=False)
    monkeypatch.delenv("STAPO_VERIFIER_FAILURE_SCORE", raising=False)
    fn = adapters.compute_score_prime
    right = "so \\boxed{4}"  # 12 characters

    monkeypatch.setenv("STAPO_VERIFIER_MAX_PREDICTION_CHARS", "12")
    assert fn("x", right, "4", None) == (1.0, "ok")
    monkeypatch.setenv("STAPO_VERIFIER_MAX_PREDICTION_CHARS", "11")
    assert fn("x", right, "4", None) == (0.0, "too_large")
    assert fn("x", right, "4", None, failure_score=-1.0) == (-1.0, "too_large")

    monkeypatch.delenv("STAPO_VERIFIER_MAX_PREDICTION_CHARS")
    monkeypatch.setenv("STAPO_VERIFIER_MAX_GOLD_CHARS", "3")
    assert fn("x", "so \\boxed{1234}", "1234", None) == (0.0, "too_large")
    monkeypatch.delenv("STAPO_VERIFIER_MAX_GOLD_CHARS")

    # under the default limit (100,000) a long response is graded, as the service and the pool grade it
    long_right = "a" * 30_000 + " so \\boxed{4}"
    assert fn("x", long_right, "4", None) == (1.0, "ok")


UNGUARDED = """
print("the script's body runs")
from stapo.verifier_service.clients.adapters import compute_score
print(compute_score(data_source="x", solution_str="so \\\\boxed{\\\\frac{3\\\\sqrt{2}}{4}}",
                    ground_truth="\\\\frac{\\\\sqrt{18}}{4}"))
"""
GUARDED = "if __name__ == '__main__':\n" + "\n".join("    " + ln for ln in UNGUARDED.strip().splitlines())


def _run_script(tmp_path, body: str, start_method: str = "forkserver"):
    import os
    import subprocess
    import sys

    script = tmp_path / "reward_script.py"
    script.write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_VERIFIER_")}
    env["STAPO_VERIFIER_WORKERS"] = "1"
    env["STAPO_VERIFIER_START_METHOD"] = start_method
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_an_unguarded_script_is_refused_before_any_worker_starts(tmp_path, start_method):
    """In-process grading from a script with no main guard: the pool's workers would import the script
    again (as ``__mp_main__``) and run its body in each. The pool refuses in the caller, naming the
    script's line and the guard, before any worker starts (the body ran once: no worker re-ran it), on
    both start methods; the same script under the guard grades."""
    from stapo.verifier_service.server.pool import UNGUARDED_MESSAGE

    bad = _run_script(tmp_path, UNGUARDED, start_method)
    assert bad.returncode != 0
    where = f"{tmp_path / 'reward_script.py'}:4"  # the compute_score call (line 1 is empty)
    assert UNGUARDED_MESSAGE.format(where=where) in bad.stderr, bad.stderr[-2000:]
    assert bad.stdout.count("the script's body runs") == 1, bad.stdout
    good = _run_script(tmp_path, GUARDED, start_method)
    assert good.returncode == 0, good.stderr[-2000:]
    assert "'score': 1.0" in good.stdout and "'status': 'ok'" in good.stdout, good.stdout


def test_unguarded_start_reads_the_scripts_line_through_calls(tmp_path):
    """The check follows the call stack back to the script's top level: a pool built in a function is
    guarded when the function is called under the guard, and not when called from the body."""
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        "from stapo.verifier_service.server.pool import unguarded_start\n"
        "def build():\n"
        "    return unguarded_start()\n"
        "print('body', build())\n"
        "if '__main__' == __name__:\n"
        "    print('guarded', build())\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines() == [f"body {script}:4", "guarded None"]
    inline = subprocess.run([sys.executable, "-c", script.read_text()], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    assert inline.splitlines() == ["body None", "guarded None"]  # no script file: workers import nothing of it


# A framework that grades on a worker thread: OpenRLHF calls ``reward_func`` through
# ``asyncio.to_thread``; others grade from a ``ThreadPoolExecutor``. The script's first line counts
# the runs of its body (one pid per line in runs.txt), in this process and in any grading worker.
COUNT = "open('runs.txt', 'a').write(f'{__import__(\"os\").getpid()}\\n')\n"
SCORE = ("compute_score(data_source='x', solution_str='so \\\\boxed{\\\\frac{3\\\\sqrt{2}}{4}}', "
         "ground_truth='\\\\frac{\\\\sqrt{18}}{4}')")
THREAD_CALLERS = {
    "asyncio.to_thread": (
        "import asyncio\n"
        "from stapo.verifier_service.clients.adapters import compute_score\n"
        "async def grade():\n"
        f"    return await asyncio.to_thread(lambda: {SCORE})\n"
        "print(asyncio.run(grade()))\n"
    ),
    "ThreadPoolExecutor": (
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from stapo.verifier_service.clients.adapters import compute_score\n"
        "with ThreadPoolExecutor(max_workers=2) as ex:\n"
        f"    print([f.result() for f in [ex.submit(lambda: {SCORE}) for _ in range(2)]])\n"
    ),
}


def _indented(body: str) -> str:
    return "if __name__ == '__main__':\n" + "".join("    " + ln + "\n" for ln in body.splitlines())


@pytest.mark.parametrize("caller", list(THREAD_CALLERS))
def test_an_unguarded_script_grading_on_a_worker_thread_runs_its_body_once(tmp_path, caller):
    """The caller's own stack holds no frame of the script's top level: the script waits on the main
    thread at the line that started the threads. The pool reads that line and refuses it, naming it,
    before any worker starts (the body ran once); the same script under the guard grades, once."""
    from stapo.verifier_service.server.pool import UNGUARDED_MESSAGE

    body = COUNT + THREAD_CALLERS[caller]
    bad = _run_script(tmp_path, body)
    runs = (tmp_path / "runs.txt").read_text().split()
    assert len(runs) == 1, f"the script's body ran {len(runs)} times: {bad.stdout[-1000:]}{bad.stderr[-2000:]}"
    assert bad.returncode != 0
    waiting = len(body.splitlines())  # the script's last line: asyncio.run(...) / the executor's results
    where = f"{tmp_path / 'reward_script.py'}:{waiting}"
    assert UNGUARDED_MESSAGE.format(where=where) in bad.stderr, bad.stderr[-2000:]

    (tmp_path / "runs.txt").unlink()
    good = _run_script(tmp_path, _indented(body))
    assert good.returncode == 0, good.stderr[-2000:]
    assert len((tmp_path / "runs.txt").read_text().split()) == 1
    assert good.stdout.count("'score': 1.0") == (1 if caller == "asyncio.to_thread" else 2), good.stdout


def test_unguarded_start_reads_the_main_threads_line_from_a_worker_thread(tmp_path):
    """From a thread, the line is the main thread's: the join in the body, or None under the guard;
    from a thread of a ``python -c`` program (no script file), None."""
    import subprocess
    import sys

    script = tmp_path / "t.py"
    script.write_text(
        "import threading\n"
        "from stapo.verifier_service.server.pool import unguarded_start\n"
        "def in_thread():\n"
        "    out = []\n"
        "    t = threading.Thread(target=lambda: out.append(unguarded_start()))\n"
        "    t.start(); t.join()\n"
        "    return out[0]\n"
        "print('body', in_thread())\n"
        "if __name__ == '__main__':\n"
        "    print('guarded', in_thread())\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.splitlines() == [f"body {script}:8", "guarded None"]
    inline = subprocess.run([sys.executable, "-c", script.read_text()], capture_output=True, text=True, timeout=60,
                            check=True).stdout
    assert inline.splitlines() == ["body None", "guarded None"]
