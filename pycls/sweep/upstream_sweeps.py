"""Upstream pycls's sweep files (its configs/sweeps/), read unchanged by our sweep tools.

A sweep file is upstream's when it gives SETUP.BASE_CFG inline (a tree of config keys), names
upstream's sampler types (float_sampler, ...) or sets a key only upstream's sweep schema has.
``translate`` turns it into our schema (pycls/sweep/sweep_file.py) as it loads, one log line per
key:

- SETUP.BASE_CFG: read as a pycls config file is (upstream's config keys translated by
  pycls.config.upstream_keys, with its log lines); its keys that differ from our defaults become
  SETUP.OVERRIDES over an empty SETUP.BASE_CFG (a sampled key is left to its sampler)
- samplers: float_sampler / int_sampler -> TYPE float / int with DIST = RAND_TYPE and
  QUANTIZE_RULE upstream; value_sampler -> TYPE choice; regnet_sampler -> TYPE regnet
- SETUP.CONSTRAINTS: the same keys (REGNET.NUM_STAGES defaults to upstream's [4, 4]);
  RNG_SEED -> SEED, NUM_SAMPLES -> MAX_DRAWS; CHUNK_SIZE and NUM_PROC have no effect
- LAUNCH: SLURM, one node of LAUNCH.NUM_GPUS GPUs per run, as upstream's sweep_launch asks
- NAME: '/' becomes '.' (one folder under ROOT_DIR); ANALYZE and COLLECT have no effect

What cannot be honoured (list_sampler, other RAND_TYPEs, LAUNCH.MODE other than train) stops
the load with a ConfigError naming the key, why, and what to use instead.
"""

import logging
import os
import tempfile

from yacs.config import CfgNode

from pycls import config
from pycls.config import upstream_keys
from pycls.errors import ConfigError, require

logger = logging.getLogger(__name__)

_SAMPLER_TYPES = ("float_sampler", "int_sampler", "value_sampler", "list_sampler")
_SAMPLER_TYPES += ("regnet_sampler",)
_UPSTREAM_SETUP = ("NUM_SAMPLES", "CHUNK_SIZE", "RNG_SEED")
_UPSTREAM_LAUNCH = ("PARALLEL_JOBS", "MAX_RETRY", "NUM_GPUS", "CPUS_PER_GPU", "MEM_PER_GPU")
_UPSTREAM_LAUNCH += ("GPU_TYPE", "TIME_LIMIT", "CONDA_ENV")
# Upstream's sweep LAUNCH defaults (its pycls/sweep/sweep_file.py)
_LAUNCH_DEFAULTS = {
    "MODE": "train",
    "PARALLEL_JOBS": 128,
    "MAX_RETRY": 3,
    "COMMENT": "",
    "NUM_GPUS": 1,
    "CPUS_PER_GPU": 10,
    "MEM_PER_GPU": 60,
    "PARTITION": "learnfair",
    "GPU_TYPE": "volta",
    "TIME_LIMIT": 4200,
}
_RAND_TYPES = ("uniform", "log_uniform")
_NO_EFFECT = {
    "ANALYZE": "the analyze step (sweep-analyze) makes its own table and plots",
    "COLLECT": "the collect step (sweep-collect) keeps every run's checkpoints",
    "NUM_PROC": "setup draws in one process",
    "SWEEP_CFG_FILE": "upstream sets it itself",
}


def is_upstream_sweep(tree):
    """True when the loaded sweep file (a dict tree) is in upstream pycls's dialect."""
    setup, launch = tree.get("SETUP") or {}, tree.get("LAUNCH") or {}
    samplers = setup.get("SAMPLERS") or {}
    return (
        isinstance(setup.get("BASE_CFG"), dict)
        or any(isinstance(s, dict) and s.get("TYPE") in _SAMPLER_TYPES for s in samplers.values())
        or any(k in setup for k in _UPSTREAM_SETUP)
        or any(k in launch for k in _UPSTREAM_LAUNCH)
        or any(k in tree for k in ("NUM_PROC", "ANALYZE", "COLLECT", "SWEEP_CFG_FILE"))
    )


def _say(key, value, became):
    logger.warning(f"{key}: upstream pycls's sweep key ({value!r}) {became}")


def base_overrides(base, pairs=()):
    """Our keys (and values) of an upstream inline BASE_CFG, read as a config file is read, with
    ``pairs`` (SETUP.BASE_CFG.<key> VALUE from the command line) as its overrides."""
    pairs = [x[len("SETUP.BASE_CFG.") :] if i % 2 == 0 else x for i, x in enumerate(pairs)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "BASE_CFG.yaml")
        with open(path, "w") as f:
            f.write(CfgNode(base).dump())
        try:
            cfg = config.load_cfg(path, pairs, validate=False)
        except ConfigError as e:
            raise ConfigError(
                f"SETUP.BASE_CFG.{e} (a key of the inline base config can be set on the command "
                "line as SETUP.BASE_CFG.<KEY> VALUE)"
            ) from None
    return {k: v for k, v in config.non_default_items(cfg) if k not in ("OUT_DIR", "CFG_DEST")}


def _sampler(key, spec):
    where = f"SETUP.SAMPLERS.{key}"
    kind = spec.get("TYPE")
    if kind == "value_sampler":
        out = {"TYPE": "choice", "VALUES": spec.get("VALUES", [])}
    elif kind in ("float_sampler", "int_sampler"):
        dist = spec.get("RAND_TYPE", "uniform")
        require(
            dist in _RAND_TYPES,
            f"{where}.RAND_TYPE",
            f"{dist!r} is not drawn here (only {_RAND_TYPES}, with upstream's quantisation); "
            "use one of those, or a value_sampler listing the values",
        )
        is_int = kind == "int_sampler"
        q = spec.get("QUANTIZE", 1 if is_int else 0.00001)
        out = {"TYPE": "int" if is_int else "float", "RANGE": spec.get("RANGE", [0, 0])}
        out.update(DIST=dist, QUANTIZE=q, QUANTIZE_RULE="upstream")
    elif kind == "regnet_sampler":
        out = {"TYPE": "regnet", **{k: v for k, v in spec.items() if k != "TYPE"}}
    elif kind == "list_sampler":
        raise ConfigError(
            f"{where}.TYPE: list_sampler (a list of independently drawn items) is not drawn "
            "here; use a value_sampler listing the lists to choose from"
        )
    else:
        raise ConfigError(f"{where}.TYPE: {kind!r} is not one of upstream's {_SAMPLER_TYPES}")
    _say(f"{where}.TYPE", kind, f"read as TYPE {out['TYPE']}")
    return out


def _setup(setup, base_pairs):
    out = {"SAMPLERS": {}, "OVERRIDES": {}}
    for key, spec in (setup.get("SAMPLERS") or {}).items():
        out["SAMPLERS"][key] = _sampler(key, spec) if isinstance(spec, dict) else spec
    sampled = {f"REGNET.{k}" for k in ("DEPTH", "W0", "WA", "WM", "GROUP_W", "BOT_MUL")}
    sampled = set(out["SAMPLERS"]) | (sampled if "REGNET" in out["SAMPLERS"] else set())
    base = setup.get("BASE_CFG")
    if isinstance(base, dict):
        overrides = base_overrides(base, base_pairs)
        out["BASE_CFG"] = ""
        out["OVERRIDES"] = {k: v for k, v in overrides.items() if k not in sampled}
        _say("SETUP.BASE_CFG", "inline config", "read as SETUP.OVERRIDES over pycls's defaults")
    else:
        require(
            not base_pairs,
            base_pairs[0] if base_pairs else "",
            "only an inline SETUP.BASE_CFG takes overrides of its keys; use SETUP.OVERRIDES",
        )
        if base is not None:
            out["BASE_CFG"] = base
    out["OVERRIDES"].update(setup.get("OVERRIDES") or {})
    constraints = dict(setup.get("CONSTRAINTS") or {})
    constraints.setdefault("REGNET", {"NUM_STAGES": [4, 4]})  # upstream's default
    out["CONSTRAINTS"] = constraints
    out["MAX_DRAWS"] = 1000000  # upstream's default NUM_SAMPLES
    renames = {"NUM_CONFIGS": "NUM_CONFIGS", "RNG_SEED": "SEED", "NUM_SAMPLES": "MAX_DRAWS"}
    for key, ours in renames.items():
        if key in setup:
            out[ours] = setup[key]
            if key != ours:
                _say(f"SETUP.{key}", setup[key], f"read as SETUP.{ours}")
    if "CHUNK_SIZE" in setup:
        _say("SETUP.CHUNK_SIZE", setup["CHUNK_SIZE"], "has no effect (setup draws in one process)")
    for key in ("SEED", "MAX_DRAWS"):  # our spellings, if a file mixes them in
        if key in setup:
            out[key] = setup[key]
    return out


def _launch(launch):
    v = {**_LAUNCH_DEFAULTS, **launch}
    require(
        v["MODE"] == "train",
        "LAUNCH.MODE",
        f"{v['MODE']!r} (run_net's mode for every run) cannot be honoured: sweeps here train "
        "only; run tools/run_net.py --mode ... --cfg on each of the sweep's cfgs/NNNN.yaml",
    )
    n = v["NUM_GPUS"]
    flat = {"NUM_GPUS": n, "MAX_GPUS_PER_NODE": n, **{f"LAUNCH.{k}": x for k, x in v.items()}}
    out = upstream_keys.sweep_launch(flat)  # one node of NUM_GPUS GPUs, as upstream's sbatch asks
    out["MAX_PARALLEL"] = v["PARALLEL_JOBS"]
    said = ", ".join(f"{k} {x!r}" for k, x in out.items())
    for key, value in launch.items():
        if key != "CONDA_ENV":
            _say(f"LAUNCH.{key}", value, f"read into our LAUNCH ({said})")
    if "CONDA_ENV" in launch:
        _say("LAUNCH.CONDA_ENV", launch["CONDA_ENV"], "has no effect (runs use this Python)")
    return out


def translate(tree, base_pairs=()):
    """Our sweep schema's tree of an upstream sweep file's tree (logging each key)."""
    out = {k: tree[k] for k in ("DESC", "ROOT_DIR") if k in tree}
    name = tree.get("NAME", "")
    out["NAME"] = name.replace("/", ".")
    if "/" in name:
        _say("NAME", name, f"read as NAME {out['NAME']} (one folder under ROOT_DIR)")
    out["SETUP"] = _setup(tree.get("SETUP") or {}, list(base_pairs))
    out["LAUNCH"] = _launch(tree.get("LAUNCH") or {})
    for key, why in _NO_EFFECT.items():
        if key in tree:
            value = "..." if isinstance(tree[key], dict) else tree[key]
            _say(key, value, f"has no effect ({why})")
    return CfgNode(out)
