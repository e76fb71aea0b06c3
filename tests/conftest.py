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


@pytest.fixture
def checkout_when_model_loads(monkeypatch):
    """``kvbits.evaluate.outputs._git_commit`` says ``started`` until a run loads its model, then ``finished``:
    a run must record the tree it started from (``{"sha": "started", "dirty": False}``)."""
    from kvbits.evaluate import inputs, outputs

    tree = ["started"]
    load = inputs._load_checked_model

    def load_then_checkout(*args, **kwargs):
        tree[0] = "finished"
        return load(*args, **kwargs)

    monkeypatch.setattr(inputs, "_load_checked_model", load_then_checkout)
    monkeypatch.setattr(outputs, "_git_commit", lambda: {"sha": tree[0], "dirty": False})


def pytest_configure(config):
    """Under pytest-xdist each worker process gets an equal share of the cores for torch's intra-op
    threads: with the default (every core in every worker) two workers on two cores oversubscribe them."""
    import os

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
