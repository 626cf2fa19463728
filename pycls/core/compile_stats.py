"""What torch.compile did in this process: graphs compiled, seconds spent, frames that fell back
to eager, and whether any repeated block ran uncompiled.

``--mode time`` (``pycls.core.benchmark``) and ``benchmarks/step_ab.py`` report these beside every
timing, so that a figure measured with a block silently running eager (a recompile limit, a graph
break) says so.

- ``snapshot()``: dynamo's counters now (graphs, frames, graph breaks, compile seconds); take
  one before and one after and ``delta()`` them for one model's share in a shared process.
- ``EagerBlockProbe``: a forward pre-hook on each repeated block counting the calls that ran
  outside a compiled graph. Inside a compiled block the hook is traced (``is_compiling()`` is
  true then, so it adds no operation to the graph) and never runs again; a block that runs
  eager runs it at every call.
"""

import torch

# Dynamo's own compile-time accounts (``torch._dynamo.utils.compilation_time_metrics``): the
# frames it converts (forward graphs, with the backend's compile) and backward graphs, which are
# compiled lazily at their first backward pass
_COMPILE_KEYS = ("_compile.compile_inner", "backward._backward_impl")


def snapshot():
    """Dynamo's counters now: ``unique_graphs``, ``frames`` (converted), ``frames_failed``
    (conversions that raised, the frame then running eager: a recompile limit, an error),
    ``graph_breaks`` and ``compile_s``."""
    utils = torch._dynamo.utils  # torch loads its compiler at first use: not at pycls's start-up
    counters = utils.counters
    frames = counters.get("frames", {})
    metrics = getattr(utils, "compilation_time_metrics", {})
    return {
        "unique_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "frames": int(frames.get("total", 0)),
        "frames_failed": int(frames.get("total", 0)) - int(frames.get("ok", 0)),
        "graph_breaks": int(sum(counters.get("graph_break", {}).values())),
        "compile_s": float(sum(sum(metrics.get(key, ())) for key in _COMPILE_KEYS)),
    }


def delta(before, after):
    """What happened between two snapshots."""
    return {key: after[key] - before[key] for key in after}


class EagerBlockProbe:
    """Counts the calls of each of ``blocks`` that ran eager (see the module docstring).

    Install it before the blocks' first call: a hook added later changes what the compiled
    graphs guard on and recompiles them."""

    def __init__(self, blocks):
        self.blocks = list(blocks)
        self.eager_calls = [0] * len(self.blocks)
        self._handles = [
            block.register_forward_pre_hook(self._hook(i)) for i, block in enumerate(self.blocks)
        ]

    def _hook(self, i):
        def count(module, args):
            if not torch.compiler.is_compiling():
                self.eager_calls[i] += 1

        return count

    def reset(self):
        self.eager_calls = [0] * len(self.blocks)

    @property
    def eager_blocks(self):
        """How many blocks ran eager at least once since the last ``reset``."""
        return sum(1 for n in self.eager_calls if n)

    def remove(self):
        for handle in self._handles:
            handle.remove()


def report(stats, eager_blocks, num_blocks, compiled):
    """The fields a timing adds (``compile_s``, ``unique_graphs``, ``frames_failed``,
    ``graph_breaks``, ``eager_blocks`` of ``num_blocks``) and the WARNING line to log when a
    compiled run left any block or frame eager (None when all is well)."""
    fields = {
        "compile_s": stats["compile_s"],
        "unique_graphs": stats["unique_graphs"],
        "frames_failed": stats["frames_failed"],
        "graph_breaks": stats["graph_breaks"],
        "eager_blocks": eager_blocks if compiled else None,
        "num_blocks": num_blocks,
    }
    warning = None
    if compiled and (eager_blocks or stats["frames_failed"]):
        warning = (
            f"{eager_blocks} of {num_blocks} blocks ran uncompiled and {stats['frames_failed']} "
            "frame(s) fell back to eager (recompile limit or compile error; "
            'TORCH_LOGS="recompiles" says why): this timing is not that of a compiled model'
        )
    return fields, warning
