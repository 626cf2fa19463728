"""What torch.compile did in this process: graphs compiled, seconds spent, frames that fell back
to eager, and whether any repeated block ran uncompiled.

``--mode time`` (``pycls.core.benchmark``) and ``benchmarks/step_ab.py`` report these beside every
timing, so that a figure measured with a block silently running eager (a recompile limit, a graph
break) says so.

- ``announce(scope, device_type)``: the log's word that the first training step compiles.
- ``snapshot()``: dynamo's counters now (graphs, frames, graph breaks, compile seconds); take
  one before and one after and ``delta()`` them for one model's share in a shared process.
- ``EagerBlockProbe``: for blocks compiled one by one (``TRAIN.COMPILE_SCOPE blocks``), counts
  the training calls of each block that ran eager: the output of a compiled block comes from
  an AOTAutograd graph (its ``grad_fn`` is the compiled function's backward), an eager block's
  from its last operation. The check wraps the block's compiled call from outside the graph, so
  it changes nothing the compiler sees.
"""

import logging

import torch

logger = logging.getLogger(__name__)
# Dynamo's own compile-time accounts (``torch._dynamo.utils.compilation_time_metrics``): the
# frames it converts (forward graphs, with the backend's compile) and backward graphs, which are
# compiled lazily at their first backward pass
_COMPILE_KEYS = ("_compile.compile_inner", "backward._backward_impl")


def announce(scope, device_type):
    """The log's word that the first step compiles (TRAIN.COMPILE_SCOPE ``scope``)."""
    logger.info(
        f"compiling the model (TRAIN.COMPILE, scope {scope}): the first step takes longer; its "
        "time is left out of time_avg and the ETA"
    )
    if device_type == "cpu":
        logger.info(
            "note: on a CPU, compiled ViT steps measured no faster than eager ones, in fp32 and "
            "bfloat16 (BENCHMARKS.md, torch.compile on the CPU)"
        )


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


def cached_graphs(fn):
    """How many compiled graphs dynamo holds now for the code of ``fn`` (a function that
    ``torch.compile`` wraps), or None where this torch cannot say."""
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    return None if entries is None else len(entries(fn.__code__))


def delta(before, after):
    """What happened between two snapshots."""
    return {key: after[key] - before[key] for key in after}


class EagerBlockProbe:
    """Counts the calls of each of ``blocks`` (compiled in place, ``nn.Module.compile``) whose
    output did not come from a compiled graph (see the module docstring). Blocks that are not
    compiled in place are not watched (``watched`` is 0: whole-model compiles, eager runs).
    Only calls that record a backward graph count (training, not ``no_grad``)."""

    def __init__(self, blocks):
        self.blocks = [b for b in blocks if getattr(b, "_compiled_call_impl", None) is not None]
        self.eager_calls = [0] * len(self.blocks)
        self._compiled = [b._compiled_call_impl for b in self.blocks]
        for i, block in enumerate(self.blocks):
            block._compiled_call_impl = self._watch(i, self._compiled[i])

    @property
    def watched(self):
        return len(self.blocks)

    def _watch(self, i, compiled):
        def call(*args, **kwargs):
            out = compiled(*args, **kwargs)
            grad_fn = getattr(out, "grad_fn", None)
            if grad_fn is not None and "Compiled" not in type(grad_fn).__name__:
                self.eager_calls[i] += 1
            return out

        return call

    def reset(self):
        self.eager_calls = [0] * len(self.blocks)

    @property
    def eager_blocks(self):
        """How many blocks ran eager at least once since the last ``reset``."""
        return sum(1 for n in self.eager_calls if n)

    def remove(self):
        for block, compiled in zip(self.blocks, self._compiled):
            block._compiled_call_impl = compiled


def report(stats, probe, num_blocks, compiled):
    """The fields a timing adds (``compile_s``, ``unique_graphs``, ``frames_failed``,
    ``graph_breaks``, ``eager_blocks`` of ``num_blocks``: None where no probe watched them,
    ``uncompiled``: whether anything of a compiled run ran eager) and the WARNING line to log
    when something did (None when all is well)."""
    eager = probe.eager_blocks if compiled and probe is not None and probe.watched else None
    uncompiled = bool(compiled and (eager or stats["frames_failed"]))
    fields = {
        "compile_s": stats["compile_s"],
        "unique_graphs": stats["unique_graphs"],
        "frames_failed": stats["frames_failed"],
        "graph_breaks": stats["graph_breaks"],
        "eager_blocks": eager,
        "num_blocks": num_blocks,
        "uncompiled": uncompiled,
    }
    warning = None
    if uncompiled:
        blocks = "" if eager is None else f"{eager} of {num_blocks} blocks ran uncompiled, "
        warning = (
            f"{blocks}{stats['frames_failed']} frame(s) fell back to eager (a recompile limit "
            'or a compile error; TORCH_LOGS="recompiles" says why): this timing is not that of '
            "a compiled model"
        )
    return fields, warning
