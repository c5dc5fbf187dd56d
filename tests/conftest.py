"""Fixtures, hooks and helpers shared by every test folder."""

from __future__ import annotations

import os

# One torch (OpenMP) thread for the whole run, set before torch is imported so every subprocess a test
# starts (grader workers, the async producer, CLI runs) inherits it too. The tests' models are tiny, and
# on 2 cores a test process plus its subprocesses at torch's default thread count oversubscribe the
# cores: measured here, tests/e2e/test_async_loop.py + test_train_tiny.py + tests/unit/test_update.py
# took 240 s wall / 218 s CPU with 2 threads and 70 s / 46 s with 1. A caller's own setting wins.
# (On 7 unit files, 107 tests: 20 s user CPU with 1 thread vs 140 s with 2, under load.)
# torch reads the variable when it is first imported, in this process too. torch itself is not
# imported here: the verifier's tests also run on Pythons without it (`make test-verifier`).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# The per-test limit of tests marked ``long`` (pyproject's ``timeout`` is everyone else's). It must
# exceed the sum of the bounds such a test puts on its own subprocesses (a 2-rank test runs torchrun
# twice, each bounded at 300 s), so the test's own cleanup (killing torchrun's process group) runs
# first and reports the better message; this limit is the backstop for a hang outside those bounds.
LONG_TIMEOUT_S = 1200


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give tests marked ``long`` the longer limit, unless they set their own ``timeout``."""
    for item in items:
        if item.get_closest_marker("long") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))


@pytest.fixture(autouse=True)
def hub_answers(monkeypatch):
    """Tests run without a network, and the shipped recipes name hub ids (Qwen/Qwen3-8B-Base): the
    pre-load probe of the hub (:func:`stapo.core.train.prepare.hub_answers`) is stood in by one that answers,
    so the launch checks get past it. A test of the probe's refusal sets its own stand-in."""
    try:
        import stapo.core.train.prepare as prepare
    except ImportError:  # the verifier's own test environment has no trainer
        return
    monkeypatch.setattr(prepare, "hub_answers", lambda endpoint, timeout_s=prepare.HUB_PROBE_S: None)


@pytest.fixture
def one_thread():
    """torch on one thread for the test. Tiny matmuls run fastest so on a shared, loaded machine, and
    an equivalence check against torchrun's ranks (which start with OMP_NUM_THREADS=1) must reduce in
    the same order: otherwise AdamW (m / sqrt(v) ~ sign(g) for tiny g) can turn 1e-9 of float noise
    in a gradient into a parameter difference near the learning rate."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def stapo_main(monkeypatch, capsys):
    """Run ``stapo ARGS...`` in this process through the console entry point -> (exit code, stdout,
    stderr): what a user's shell sees, typer's own argument handling included."""

    def run(*args: str) -> tuple[int, str, str]:
        import sys

        from stapo.cli.main import main

        monkeypatch.setattr(sys, "argv", ["stapo", *args])
        with pytest.raises(SystemExit) as exc:
            main()
        out = capsys.readouterr()
        return int(exc.value.code or 0), out.out, out.err

    return run


@pytest.fixture
def stub_train(monkeypatch) -> list:
    """``stapo train`` up to the library: its one call into it (``stapo.cli.train.run_training``)
    records the config it was given and returns at once (the CLI's checks, plan and run-dir handling
    all run). The list fills with those configs."""
    from stapo.cli import train
    from stapo.core.train.loop import TrainResult

    seen: list = []

    def finishes(prepared, *, log):
        seen.append(prepared.cfg)
        return TrainResult(prepared.run_dir, prepared.cfg.trainer.max_steps, None, None, 0.0)

    monkeypatch.setattr(train, "run_training", finishes)
    return seen
