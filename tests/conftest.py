"""Fixtures and rules every test runs under (tests/README.md says where a test goes).

Threads: every test runs with one intra-op thread, and so does every process a test starts
(through ``OMP_NUM_THREADS``, which torch reads at start-up). The tensors here are tiny: extra
threads only add synchronisation, and when other processes hold the cores (CI on a shared 2-core
machine, two gloo ranks, loader workers) spinning OpenMP threads make an epoch up to 50x slower
(BENCHMARKS.md). Set ``PYCLS_TEST_THREADS`` to run the suite with more threads.

Nothing started unasked, nothing left behind: the tests marked ``slurm`` start a local SLURM
cluster only with PYCLS_TEST_SLURM=1 (otherwise they skip, saying how to run them), and the
``slurm`` fixture stops the cluster it started. Every process a test starts carries this pytest
process's pid in PYCLS_TEST_OWNERS; a test file that leaves one running fails at its end, naming
it (which is then killed), and so does a whole run that leaves any behind, daemons included
(checked once every worker has ended).

Time limits catch hangs, never speed: pytest-timeout's (pyproject.toml) and every other limit a
test sets is at least 10x its step's time on an idle machine and grows with the machine's load
(``tests.helpers.scaled``).
"""

import os

import pytest
import torch

from tests.helpers import processes, scaled, warm
from tests.helpers import slurm as local_slurm
from tests.helpers.cpu_times import CpuTimes

TEST_THREADS = int(os.environ.get("PYCLS_TEST_THREADS", "1"))

# Before any test module imports torch's workers or spawns a process: children inherit it
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))
os.environ.setdefault("MKL_NUM_THREADS", str(TEST_THREADS))
# torch.compile's code generation in the process itself, not in a pool of worker processes that
# lives as long as the test process (and competes for the cores)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# What pycls caches of the machine (the CPU's bfloat16 probe) goes to a folder of this test run,
# measured once here, not to the user's ~/.cache
if "PYCLS_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["PYCLS_CACHE_DIR"] = tempfile.mkdtemp(prefix="pycls-test-cache-")
# Every process started from here on names this one among its owners (a pytest run inside a test
# adds its own)
_owners = os.environ.get(processes.OWNERS, "")
os.environ[processes.OWNERS] = f"{_owners}:{os.getpid()}".lstrip(":")

# Processes that session-scoped fixtures keep running on purpose (the SLURM cluster's daemons)
_KEPT = set()


# ------------------------------------------------------------------------------------------------ #
# Processes: none left behind
# ------------------------------------------------------------------------------------------------ #


@pytest.fixture(autouse=True, scope="module")
def no_process_left_behind(request):
    """A test file ends every process its tests started (loader workers, process groups,
    torchrun agents, servers, daemons): one still running when the file is done fails it."""
    if not processes.supported():
        yield
        return
    before = set(processes.owned())
    yield
    left = processes.still_running(set(processes.owned()) - before - _KEPT)
    if left:
        processes.end(left)
        pytest.fail(
            f"{request.node.nodeid} left {len(left)} process(es) running (now killed):\n"
            f"{processes.describe(left)}",
            pytrace=False,
        )


def pytest_sessionstart(session):
    if processes.supported() and not hasattr(session.config, "workerinput"):
        session.config._pycls_before = set(processes.owned())


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session, exitstatus):
    """The whole run left no process running: checked by the process that ran pytest (xdist's
    controller, or the only process), after every session fixture ended and xdist's workers
    exited, so that it sees what any test of any worker started, daemons included. What is left
    is named, then killed, and the run fails."""
    result = yield
    before = getattr(session.config, "_pycls_before", None)
    if before is None:  # an xdist worker (the controller checks), or no /proc
        return result
    left = processes.still_running(set(processes.owned()) - before)
    if left:
        processes.end(left)
        message = (
            f"the tests left {len(left)} process(es) running at the end of the run (now "
            f"killed):\n{processes.describe(left)}"
        )
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result


# ------------------------------------------------------------------------------------------------ #
# Two workers (pytest-xdist), and the tests that must share one
# ------------------------------------------------------------------------------------------------ #


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-times",
        action="store_true",
        help="after the run, the CPU and wall seconds of the tests by file and by marker",
    )


def pytest_configure(config):
    """With ``-n N`` and no ``--dist`` of the caller's, tests are sent to the workers one by one,
    but those of an ``xdist_group`` together (``--dist loadgroup``)."""
    config.addinivalue_line("markers", "xdist_group(name): run on one xdist worker, in one go")
    if config.getoption("--cpu-times"):
        config.pluginmanager.register(CpuTimes(config), "pycls_cpu_times")
    args = config.invocation_params.args
    named = any(str(a).startswith(("--dist", "-d")) for a in args)
    if getattr(config.option, "dist", "no") == "load" and not named:
        config.option.dist = "loadgroup"
    # A worker reads --dist from the command line, not from the controller: told here, it marks
    # the grouped tests' ids for the controller's loadgroup scheduling
    if getattr(config, "workerinput", {}).get("pycls_loadgroup"):
        config.option.loadgroup = True


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # before pytest-timeout reads the limit
def pytest_runtest_protocol(item):
    """pytest-timeout's limit of a test (pyproject.toml's ``timeout``: 10x the slowest test's
    time on an idle machine, or the test's own ``timeout`` mark) scaled with the machine's load
    as the test starts: a limit catches a hang, never a busy machine."""
    marked = item.get_closest_marker("timeout")
    try:
        limit = marked.args[0] if marked and marked.args else item.config.getini("timeout")
    except ValueError:  # pytest-timeout is not installed
        limit = None
    limit = item.config.getoption("timeout", None) or limit
    if limit and float(limit) > 0:
        item.add_marker(pytest.mark.timeout(scaled(float(limit))), append=False)
    yield


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """(pytest-xdist's hook, in the controller) tells each worker whether tests are grouped."""
    node.workerinput["pycls_loadgroup"] = node.config.option.dist == "loadgroup"


def _shares_state(item):
    """The test uses a module- or class-scoped fixture of its own file (a spawned process group,
    a trained run several tests read): those tests go to one worker, which builds it once."""
    info = getattr(item, "_fixtureinfo", None)  # a test function's (pytest keeps it private)
    for fixturedefs in info.name2fixturedefs.values() if info is not None else ():
        for fixturedef in fixturedefs:
            if fixturedef.scope in ("module", "class") and fixturedef.baseid.endswith(".py"):
                return True
    return False


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    asked = local_slurm.asked()
    for item in items:
        if "slurm" in item.keywords:
            # the SLURM tests share the session's cluster: one worker starts and stops it
            item.add_marker(pytest.mark.xdist_group("slurm"))
            if not asked:
                item.add_marker(pytest.mark.skip(reason=local_slurm.NOT_ASKED))
        elif _shares_state(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if getattr(config, "workerinput", {}).get("pycls_loadgroup"):
        # xdist sends the groups first, the largest first, then the other tests in this order:
        # the slow ones first, so that the run does not end on a long test that one worker runs
        # while the other has nothing left (a stable sort: each file's tests keep their order)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# ------------------------------------------------------------------------------------------------ #
# The local SLURM cluster, only when asked
# ------------------------------------------------------------------------------------------------ #


@pytest.fixture(scope="session")
def slurm():
    """The environment of a running local SLURM cluster (SLURM_CONF set): the one already running,
    or one started here and stopped at the end of the run. Skips unless PYCLS_TEST_SLURM=1, or
    with the reason when the cluster cannot start."""
    if not local_slurm.asked():
        pytest.skip(local_slurm.NOT_ASKED)
    before = set(processes.owned()) if processes.supported() else set()
    try:
        env, started = local_slurm.start()
    except RuntimeError as e:
        pytest.skip(f"no local SLURM cluster (tools/slurm/local_cluster.sh start): {e}")
    kept = set(processes.owned()) - before if processes.supported() else set()
    _KEPT.update(kept)
    yield env
    if started:
        local_slurm.cluster("stop")
    _KEPT.difference_update(kept)


# ------------------------------------------------------------------------------------------------ #
# Warm processes
# ------------------------------------------------------------------------------------------------ #


@pytest.fixture
def warm_num_procs(monkeypatch):
    """A NUM_PROCS run started in this process (cli.main, train_model) starts its processes warm
    (tests/helpers/warm.py) instead of in fresh interpreters: for the tests whose point is what
    the processes do, not how they start (test_distributed's and test_tensor_parallel's NUM_PROCS
    tests keep the launcher's own start)."""
    monkeypatch.setattr(torch.multiprocessing, "start_processes", warm.start_processes)


# ------------------------------------------------------------------------------------------------ #
# Threads
# ------------------------------------------------------------------------------------------------ #


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
