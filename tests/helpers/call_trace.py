"""Calls followed through the layers of tests/test_layers.py's order while some work runs: how
often the work goes back up the layers.

A value is followed as it is handed on: a call that receives it (or anything derived from it
that ``carries`` recognises: a path under DATA.PATH, a record holding it) is a step of its way.
The steps are taken in the order they happen, thread by thread, each in the layer of the module
whose function it calls; a step into a higher layer than the step before is the value going back
up (``climbs``). A one-way run hands the value down: decided once where it is first read, then
given to the layers below, never returned to a layer above to be looked at again.

    with LayerTrace(carries=lambda v: ...) as trace:
        build_the_data()
    assert len(trace.climbs()) <= 2, trace.describe()
"""

import ast
import os
import sys
import threading
from dataclasses import dataclass

from tests.helpers import ROOT


def layers():
    """The layer order, lowest first, as tests/test_layers.py declares it (read from its source:
    a test module is not imported by another): [(name, [module prefixes])]."""
    with open(os.path.join(ROOT, "tests", "test_layers.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LAYERS":
            return ast.literal_eval(node.value)
    raise LookupError("tests/test_layers.py declares no LAYERS")


def layer_of(module, order=None):
    """The index of ``module``'s layer (None outside the order): the first layer one of whose
    prefixes it equals or extends ("pycls" alone is the package's own __init__)."""
    for index, (_, prefixes) in enumerate(order or layers()):
        if any(module == p or (p != "pycls" and module.startswith(p + ".")) for p in prefixes):
            return index
    return None


@dataclass(frozen=True)
class Step:
    """One call that received the followed value: its thread, module, function and layer."""

    thread: int
    module: str
    function: str
    layer: int


class LayerTrace:
    """A context that records every call into a pycls function (``sys.setprofile``, and
    ``threading.setprofile`` for the threads started inside) whose arguments ``carries`` recognises,
    in the layer order of tests/test_layers.py; layers below ``lowest`` are not followed (the
    leaves: utilities such as ``printable_path`` that every layer calls and that hand nothing
    on)."""

    def __init__(self, carries, lowest=1):
        order = layers()
        self.layer_of = lambda module: layer_of(module, order)
        self.carries, self.lowest = carries, lowest
        self.steps: list[Step] = []
        self._lock = threading.Lock()

    def __enter__(self):
        self._previous = sys.getprofile(), threading.getprofile()
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._previous[0])
        threading.setprofile(self._previous[1])
        return False

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("pycls"):
            return
        layer = self.layer_of(module)
        if layer is None or layer < self.lowest or not self._receives(frame):
            return
        step = Step(threading.get_ident(), module, frame.f_code.co_name, layer)
        with self._lock:
            self.steps.append(step)

    def _receives(self, frame):
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if code.co_flags & 0x04:  # *args
            names += (code.co_varnames[code.co_argcount + code.co_kwonlyargcount],)
        values = [frame.f_locals.get(name) for name in names]
        return any(self._carried(v) for v in values)

    def _carried(self, value):
        try:
            if isinstance(value, (list, tuple)):
                return any(self.carries(v) for v in value[:64])
            return self.carries(value)
        except Exception:  # noqa: BLE001 (an object that refuses to be looked at carries nothing)
            return False

    def climbs(self) -> list[tuple[Step, Step]]:
        """(the step before, the step into a higher layer) for every climb, thread by thread."""
        found, last = [], {}
        for step in self.steps:
            before = last.get(step.thread)
            if before is not None and step.layer > before.layer:
                found.append((before, step))
            last[step.thread] = step
        return found

    def describe(self) -> str:
        """The climbs in words, for a failing assertion."""
        return "\n".join(
            f"{a.module}.{a.function} (layer {a.layer}) -> {b.module}.{b.function} "
            f"(layer {b.layer})"
            for a, b in self.climbs()
        )
