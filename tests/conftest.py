"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest
import torch


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
