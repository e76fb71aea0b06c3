"""Shared test fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors and token-by-token decoding run tiny matmuls: a second intra-op thread only adds
    synchronisation (measured 4-20x slower on a busy 2-core machine). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    """Under pytest-xdist each worker process gets an equal share of the cores for torch's intra-op
    threads: with the default (every core in every worker) two workers on two cores oversubscribe them."""
    import os

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
