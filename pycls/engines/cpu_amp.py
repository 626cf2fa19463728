"""Which AMP level a CPU runs (AMP.CPU_LEVEL auto): decided by measuring, not by CPU flags.

A CPU without native bfloat16 arithmetic emulates it through fp32 with conversions around every
operator, and some CPUs that list bfloat16 instructions (AVX512-BF16 without AMX) still run a
training step slower in bfloat16 than in fp32. So the decision is a measurement: a short probe
times the forward and backward pass of a transformer MLP block (LayerNorm, Linear, GELU, Linear)
in fp32 and under bfloat16 autocast, and bfloat16 is kept only where it is at least
``MIN_SPEEDUP`` times faster. The two figures are cached per machine (CPU model, torch version,
threads) in ``cache_dir()``, so the probe runs once, and are given with the decision.
"""

import json
import os
import time

import torch
from torch import nn

from pycls.atomic_files import write_text_atomic

# bfloat16 must be this much faster than fp32 to be kept: below it, its rounding is not worth it
MIN_SPEEDUP = 1.1
# /proc/cpuinfo flags that mean native bfloat16 arithmetic: Intel AMX tiles, AVX512-BF16 and Arm's
# BF16 extension; reported beside the measurement, and used alone where measuring is not possible
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
_CACHE_FILE = "cpu_bf16_probe.json"


def cpu_bf16_flags(cpuinfo=None):
    """The native-bfloat16 flags the CPU reports, from ``cpuinfo`` (default: /proc/cpuinfo);
    empty where the file cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return ()
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return tuple(flag for flag in BF16_FLAGS if flag in flags)


def cpu_model_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("model name", "cpu model", "hardware"):
                    return value.strip()
    except OSError:
        pass
    return "unknown CPU"


def cache_dir():
    """Where pycls caches what it measured of this machine: $PYCLS_CACHE_DIR, else
    $XDG_CACHE_HOME/pycls, else ~/.cache/pycls."""
    if os.environ.get("PYCLS_CACHE_DIR"):
        return os.environ["PYCLS_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pycls")


def _probe_key(threads):
    return f"{cpu_model_name()} | torch {torch.__version__} | {threads} thread(s)"


def time_mlp_steps(tokens=256, width=384, rounds=7):
    """(fp32 seconds, bfloat16 seconds): the fastest of ``rounds`` forward and backward passes of
    a transformer MLP block on the CPU in fp32 and under bfloat16 autocast, the two alternating
    round by round (a busy machine slows both alike), after one warm-up pass each."""
    gen = torch.Generator().manual_seed(0)
    block = nn.Sequential(
        nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
    )
    x = torch.randn(tokens, width, generator=gen)

    def once(dtype):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is torch.bfloat16):
            out = block(x)
        out.float().sum().backward()
        return time.perf_counter() - start

    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    for i in range(rounds + 1):  # round 0 warms up (allocations, kernel selection)
        for dtype in best:
            seconds = once(dtype)
            best[dtype] = min(best[dtype], seconds) if i else best[dtype]
    return best[torch.float32], best[torch.bfloat16]


def measure_cpu_bf16(use_cache=True):
    """(fp32 seconds, bfloat16 seconds) of the probe on this machine, from the cache when it has
    them; measured (and cached) otherwise."""
    threads = torch.get_num_threads()
    key, path = _probe_key(threads), os.path.join(cache_dir(), _CACHE_FILE)
    cached = _read_cache(path) if use_cache else {}
    if isinstance(cached.get(key), list) and len(cached[key]) == 2:
        return tuple(float(t) for t in cached[key])
    figures = time_mlp_steps()
    if use_cache:
        _write_cache(path, {**cached, key: list(figures)})
    return figures


def _read_cache(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path, data):
    """Atomically, and silently skipped where the folder cannot be written."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_text_atomic(path, json.dumps(data))
    except OSError:
        pass


def decide_cpu_level(level, dtype, cpu_level, measure=measure_cpu_bf16):
    """(the AMP level a CPU device runs, a note saying what was decided and why, or None).

    ``cpu_level`` (AMP.CPU_LEVEL): "same" keeps ``level``, "O0" runs fp32, "auto" keeps a
    bfloat16 ``level`` where ``measure()`` (fp32 seconds, bfloat16 seconds) finds bfloat16 at
    least MIN_SPEEDUP times faster, and runs fp32 elsewhere; float16 runs as O0 under "auto"
    (CPUs have no fast float16 arithmetic). ``measure`` None: decide from the CPU's flags alone
    (where a measurement could differ between processes that must agree).
    """
    if cpu_level == "same" or level == "O0":
        return level, None
    if cpu_level == "O0":
        why = "AMP.CPU_LEVEL O0"
    elif dtype != "bfloat16":
        why = "AMP.CPU_LEVEL auto keeps only bfloat16 on a CPU"
    elif measure is None:
        flags = cpu_bf16_flags()
        if flags:
            return level, (
                f"AMP.LEVEL {level} (bfloat16) runs as is on this CPU: it lists native bfloat16 "
                f"({', '.join(flags)}; not measured in a multi-process launch); AMP.CPU_LEVEL O0 "
                "runs fp32 instead"
            )
        why = "this CPU lists no native bfloat16 (no amx_bf16, avx512_bf16 or Arm bf16 flag)"
    else:
        fp32, bf16 = measure()
        figures = (
            f"a transformer MLP step measured {fp32 * 1e3:.2f} ms in fp32 and {bf16 * 1e3:.2f} ms "
            f"in bfloat16 on this CPU"
        )
        if fp32 >= MIN_SPEEDUP * bf16:
            return level, (
                f"AMP.LEVEL {level} (bfloat16) runs as is: {figures} ({fp32 / bf16:.2f}x); "
                "AMP.CPU_LEVEL O0 runs fp32 instead"
            )
        why = f"{figures}: bfloat16 is not {MIN_SPEEDUP}x faster here"
    note = f"AMP.LEVEL {level} runs as O0 on the CPU ({why}); AMP.CPU_LEVEL same keeps AMP.LEVEL"
    return "O0", note
