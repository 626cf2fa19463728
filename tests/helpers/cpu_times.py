"""``--cpu-times``: where the suite's time goes, by file, by marker and by its costliest tests, in
CPU seconds (user + system of the test process and of the processes it started: spawned process
groups, torchrun, subprocesses, a fork server's children) beside wall seconds. CPU time hardly
changes with what else the machine runs, so it ranks the tests on a busy machine as on an idle
one. Works under xdist: each worker measures its tests, the main process adds them up."""

import collections
import os
import resource
import time

import pytest

MARKERS = ("slow", "slurm", "gpu")
TOP_TESTS = 25  # the costliest tests listed by CPU seconds
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _live_descendants_cpu():
    """User + system seconds of this process's live descendants, with what each has reaped of
    its own children (a fork server's processes): /proc on Linux, else nothing."""
    if not os.path.isdir("/proc/self"):
        return 0.0
    parent, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields[1])
        ticks[int(entry)] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    me, total = os.getpid(), 0
    for pid in parent:
        ancestor, hops = parent[pid], 0
        while ancestor not in (0, 1, me) and hops < 64:
            ancestor, hops = parent.get(ancestor, 0), hops + 1
        if ancestor == me and pid != me:
            total += ticks[pid]
    return total / _TICK


def _cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return reaped + _live_descendants_cpu()


class CpuTimes:
    def __init__(self, config):
        self.config = config
        self.started = {}
        self.rows = {}  # nodeid -> (cpu, wall, markers)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.started[item.nodeid] = (_cpu(), time.monotonic())
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when == "teardown" and item.nodeid in self.started:
            cpu, wall = self.started.pop(item.nodeid)
            markers = [m for m in MARKERS if item.get_closest_marker(m) is not None]
            report.user_properties.append(
                ("cpu_times", (_cpu() - cpu, time.monotonic() - wall, markers))
            )

    def pytest_runtest_logreport(self, report):
        for name, value in report.user_properties:
            if name == "cpu_times" and report.when == "teardown":
                self.rows[report.nodeid] = value

    def pytest_terminal_summary(self, terminalreporter):
        if hasattr(self.config, "workerinput") or not self.rows:
            return
        files = collections.defaultdict(lambda: [0.0, 0.0, 0])
        marks = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for nodeid, (cpu, wall, markers) in self.rows.items():
            for table, key in [(files, nodeid.split("::")[0])] + [
                (marks, m) for m in markers or ["(none)"]
            ]:
                table[key][0] += cpu
                table[key][1] += wall
                table[key][2] += 1
        write = terminalreporter.write_line
        terminalreporter.section("CPU and wall seconds of the tests (setup + call + teardown)")
        total_cpu = sum(v[0] for v in files.values())
        total_wall = sum(v[1] for v in files.values())
        write(f"{'CPU s':>8} {'wall s':>8} {'tests':>6}  file")
        for name, (cpu, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
            write(f"{cpu:8.1f} {wall:8.1f} {n:6d}  {name}")
        write(f"{total_cpu:8.1f} {total_wall:8.1f} {len(self.rows):6d}  all")
        write(f"{'CPU s':>8} {'wall s':>8} {'tests':>6}  marker")
        for name, (cpu, wall, n) in sorted(marks.items(), key=lambda kv: -kv[1][0]):
            write(f"{cpu:8.1f} {wall:8.1f} {n:6d}  {name}")
        write(f"{'CPU s':>8} {'wall s':>8} {'':>6}  the {TOP_TESTS} costliest tests")
        costliest = sorted(self.rows.items(), key=lambda kv: -kv[1][0])[:TOP_TESTS]
        for nodeid, (cpu, wall, _) in costliest:
            write(f"{cpu:8.1f} {wall:8.1f} {'':>6}  {nodeid}")
