"""Fixtures shared by the test files."""

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-tensor tests: extra threads only add
    synchronisation, which stalls for milliseconds per op when other processes hold the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
