"""The processes a test run starts, found again in /proc: every process a test starts inherits
PYCLS_TEST_OWNERS (tests/conftest.py appends the pid of each pytest process to it), so a
process left running is found whoever its parent is now, daemons and orphans included; children
started with an environment of their own are found as descendants of the pytest process.
Processes of other runs (another checkout's tests, a cluster started by hand) are not this
run's, whatever they are."""

import contextlib
import os
import signal
import time

OWNERS = "PYCLS_TEST_OWNERS"
# Helpers Python and torch keep for the life of the process that started them and end with it:
# not left behind by a test (but what a fork server forked is: a process of the test's)
RUNTIME_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "torch._inductor.compile_worker",
    "torch/_inductor/compile_worker",
)


def supported():
    return os.path.isdir("/proc/self")


def _read(pid, name):
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def _table():
    """{pid: (ppid, comm, command line, owners)} of the live processes (zombies left out) that
    this user may read."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = _read(entry, "stat").decode(errors="replace")
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            if state in ("Z", "X"):
                continue
            cmdline = _read(entry, "cmdline").replace(b"\0", b" ").decode(errors="replace")
            owners = ""
            for var in _read(entry, "environ").split(b"\0"):
                if var.startswith(OWNERS.encode() + b"="):
                    owners = var.split(b"=", 1)[1].decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone, or another user's
        table[int(entry)] = (int(ppid), comm, cmdline.strip() or f"[{comm}]", owners)
    return table


def owned(owner=None):
    """{pid: command line} of the live processes that pytest process ``owner`` (default: this
    one) started, directly or not, but Python's and torch's helpers that end with it."""
    owner = os.getpid() if owner is None else owner
    table = _table()
    found = {}
    for pid, (_, _, cmdline, owners) in table.items():
        ancestor, seen = table.get(pid, (0,))[0], set()
        descendant = False
        while ancestor > 1 and ancestor not in seen:
            if ancestor == owner:
                descendant = True
                break
            seen.add(ancestor)
            ancestor = table.get(ancestor, (0,))[0]
        ours = descendant or str(owner) in owners.split(":")
        if ours and pid != owner and not _runtime_helper(table, pid):
            found[pid] = cmdline
    return found


def _runtime_helper(table, pid):
    """A helper of RUNTIME_HELPERS itself, not a process it forked (a fork server's children
    have its command line)."""
    ppid, _, cmdline, _ = table[pid]
    parent = table.get(ppid, (0, "", "", ""))[2]
    return any(helper in cmdline and helper not in parent for helper in RUNTIME_HELPERS)


def still_running(pids, grace=10.0):
    """Those of ``pids`` that this pytest process still owns after up to ``grace`` seconds on an
    idle machine, scaled with its load (a process a test ended may take a moment to go):
    {pid: command line}."""
    from tests.helpers import scaled  # the package, which imports this module's siblings

    deadline = time.monotonic() + scaled(grace)
    while True:
        left = {pid: cmd for pid, cmd in owned().items() if pid in pids}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def end(pids):
    """SIGKILL to each of ``pids`` still there."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def describe(left):
    return "\n".join(f"  pid {pid}: {cmd[:300]}" for pid, cmd in sorted(left.items()))
