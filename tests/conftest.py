"""Fixtures and hooks shared by every test folder."""

from __future__ import annotations

import os

# One OpenMP thread per process unless the caller sets OMP_NUM_THREADS (set before torch loads, so the
# test process and every subprocess it starts inherit it). The suite's models are tiny; a second thread
# buys nothing, and on a busy 2-core machine threads that spin waiting for a core burn CPU: measured on
# 7 unit files (107 tests), 20 s user CPU with 1 thread vs 140 s with 2 under load.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

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


@pytest.fixture
def one_thread():
    """torch on one thread for the test. Tiny matmuls run fastest so on a shared, loaded machine, and
    an equivalence check against torchrun's ranks (which start with OMP_NUM_THREADS=1) must reduce in
    the same order: otherwise AdamW (m / sqrt(v) ~ sign(g) for tiny g) can turn 1e-9 of float noise
    in a gradient into a parameter difference near the learning rate."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
