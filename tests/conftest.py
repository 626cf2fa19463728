"""Fixtures shared by the test files.

Every test runs with one intra-op thread, and so does every process a test starts (through
``OMP_NUM_THREADS``, which torch reads at start-up). The tensors here are tiny: extra threads only
add synchronisation, and when other processes hold the cores (CI on a shared 2-core machine, two
gloo ranks, loader workers) spinning OpenMP threads make an epoch up to 50x slower (BENCHMARKS.md).
Set ``PYCLS_TEST_THREADS`` to run the suite with more threads.
"""

import os

import pytest
import torch

TEST_THREADS = int(os.environ.get("PYCLS_TEST_THREADS", "1"))

# Before any test module imports torch's workers or spawns a process: children inherit it
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))
os.environ.setdefault("MKL_NUM_THREADS", str(TEST_THREADS))
# What pycls caches of the machine (the CPU's bfloat16 probe) goes to a folder of this test run,
# measured once here, not to the user's ~/.cache
if "PYCLS_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PYCLS_CACHE_DIR"] = tempfile.mkdtemp(prefix="pycls-test-cache-")


@pytest.fixture(autouse=True, scope="session")
def pinned_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for a module of tiny-tensor tests, even if a test before it changed
    the count (the session already starts with ``TEST_THREADS``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
