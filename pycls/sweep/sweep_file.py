"""The sweep file: its schema (every key documented here), loading, validation and folder layout.

A sweep file is a small YAML tree, separate from the pycls config tree. It names a base pycls
config, fixed overrides, the keys to vary (``SETUP.SAMPLERS``, see ``pycls/sweep/samplers.py``),
where the sweep lives (``ROOT_DIR/NAME``) and how its runs are launched. ``load_sweep_cfg`` merges
a file and ``KEY VALUE`` pairs into the defaults and validates the result; a bad key or value
raises ``ConfigError`` naming the key, as the pycls config does.

Folder layout of a sweep (all under ``ROOT_DIR/NAME``)::

    sweep.yaml          the resolved sweep file (written by setup)
    cfgs/NNNN.yaml      one full pycls config per point
    logs/NNNN/          each run's OUT_DIR (stdout.log, checkpoints/, config.yaml)
    launch/jobs.json    the submitit job of each run (id, stdout and stderr paths)
    launch/submitit/    submitit's own files (pickles, job stdout and stderr)
    sweep.json          every run's results (written by collect)
    analysis/           summary.md and PNG plots (written by analyze)
"""

import ast
import os
import re

from yacs.config import CfgNode

from pycls import config
from pycls.config import ConfigError
from pycls.config import require as _require
from pycls.sweep import upstream_sweeps
from pycls.sweep.constraints import check_constraints
from pycls.sweep.keys import check_pycls_key, coerce_value
from pycls.sweep.samplers import validate_samplers
from pycls.yaml_keys import (
    check_duplicate_keys,
    did_you_mean,
    dotted_keys,
    type_mismatch_in_words,
)

_C = CfgNode()


# ------------------------------------------------------------------------------------------------ #
# Identity and place
# ------------------------------------------------------------------------------------------------ #

# Name of the sweep and of its folder under ROOT_DIR (letters, digits, '.', '-', '_'; one folder
# inside ROOT_DIR, so neither '.' nor '..'); required
_C.NAME = ""

# Folder that holds sweeps; required. On SLURM it must be visible from every node (not /tmp). A
# relative path is taken from the current folder and stored absolute
_C.ROOT_DIR = ""

# Free-text description, kept in sweep.yaml
_C.DESC = ""


# ------------------------------------------------------------------------------------------------ #
# Setup: which configs the sweep runs
# ------------------------------------------------------------------------------------------------ #
_C.SETUP = CfgNode()

# Base pycls config of every run. A relative path is looked up in the current folder, then among
# the configs shipped with pycls (so "configs/quickstart.yaml" works from anywhere, an installed
# wheel included); stored absolute. Empty
# with OVERRIDES set: the runs start from pycls's defaults (what an upstream sweep file's inline
# BASE_CFG becomes, see pycls/sweep/upstream_sweeps.py)
_C.SETUP.BASE_CFG = ""

# Fixed overrides of the base config, applied to every run, as dotted pycls keys:
#   OVERRIDES: {OPTIM.MAX_EPOCH: 10, TRAIN.BATCH_SIZE: 256}
# On the command line: SETUP.OVERRIDES.OPTIM.MAX_EPOCH 10
_C.SETUP.OVERRIDES = CfgNode(new_allowed=True)

# The keys to vary, as dotted pycls keys, each with a sampler (see pycls/sweep/samplers.py):
#   SAMPLERS:
#     OPTIM.BASE_LR: {TYPE: grid, VALUES: [1.0e-3, 2.0e-3]}
#     OPTIM.WEIGHT_DECAY: {TYPE: float, DIST: log_uniform, RANGE: [1.0e-3, 1.0e-1]}
# Grid samplers form a product; random samplers are drawn NUM_CONFIGS times and each draw is
# crossed with the whole grid
_C.SETUP.SAMPLERS = CfgNode(new_allowed=True)

# Number of random draws (distinct points) of the random samplers; 0 when every sampler is a grid
_C.SETUP.NUM_CONFIGS = 0

# Seed of the random samplers: the same file and seed give the same points, and raising
# NUM_CONFIGS keeps the existing points and appends new ones
_C.SETUP.SEED = 0

# Most points (runs) a sweep may have: the grid's size x max(NUM_CONFIGS, 1) is counted when the
# file loads, before any point is made, and a larger sweep is refused (raise it to run one)
_C.SETUP.MAX_POINTS = 10000

# Most random draws tried to find NUM_CONFIGS distinct points that meet the constraints
# (0 = 100 x NUM_CONFIGS)
_C.SETUP.MAX_DRAWS = 0

# Constraints a random point must meet, else it is drawn again (pycls/sweep/constraints.py).
# CX: per-image complexity of the resolved run config (the builders' analytic count at
# TRAIN.IM_SIZE) within [LOW, HIGH]; a 0 end is open ([0, 0] = no constraint). FLOPS are
# multiply-adds, ACTS activations
_C.SETUP.CONSTRAINTS = CfgNode()
_C.SETUP.CONSTRAINTS.CX = CfgNode()
_C.SETUP.CONSTRAINTS.CX.FLOPS = [0, 0]
_C.SETUP.CONSTRAINTS.CX.PARAMS = [0, 0]
_C.SETUP.CONSTRAINTS.CX.ACTS = [0, 0]
# MODEL.TYPE regnet only: the number of stages REGNET.{WA,W0,WM,DEPTH} give within [LOW, HIGH],
# with every stage the rule allows present (upstream's rule; [0, 0] = no constraint)
_C.SETUP.CONSTRAINTS.REGNET = CfgNode()
_C.SETUP.CONSTRAINTS.REGNET.NUM_STAGES = [0, 0]


# ------------------------------------------------------------------------------------------------ #
# Launch: how the runs are started (submitit)
# ------------------------------------------------------------------------------------------------ #
_C.LAUNCH = CfgNode()

# "local" (submitit's LocalExecutor: subprocesses of this machine, waits for them) or "slurm"
# (one job array, one job per run)
_C.LAUNCH.MODE = "local"

# Runs at the same time: local processes, or the SLURM array's parallelism limit (0 = no limit)
_C.LAUNCH.MAX_PARALLEL = 1

# SLURM partition ("" = the cluster's default)
_C.LAUNCH.PARTITION = ""

# Nodes per run (SLURM)
_C.LAUNCH.NODES = 1

# GPUs per node and run. SLURM starts one task (one training process) per GPU; locally each of
# the MAX_PARALLEL slots gets its own GPUS_PER_NODE GPUs (0 = CPU only)
_C.LAUNCH.GPUS_PER_NODE = 0

# CPU cores per task (per GPU; per run when GPUS_PER_NODE is 0) on SLURM
_C.LAUNCH.CPUS_PER_TASK = 10

# Host memory per node in GB on SLURM (0 = the partition's default)
_C.LAUNCH.MEM_GB = 0

# Time limit of one job in minutes (also the local timeout); a run that needs longer is requeued
# at the limit and resumes from its last checkpoint, up to MAX_REQUEUE times
_C.LAUNCH.TIME_LIMIT_MIN = 4320

# How often a run may be requeued after hitting TIME_LIMIT_MIN (preempted jobs are always
# requeued and resume from their last checkpoint)
_C.LAUNCH.MAX_REQUEUE = 3

# sbatch --comment (some partitions require one), --constraint (e.g. a GPU type), --account
_C.LAUNCH.COMMENT = ""
_C.LAUNCH.CONSTRAINT = ""
_C.LAUNCH.ACCOUNT = ""

# SLURM only: wait for every job and report failures (local launches always wait)
_C.LAUNCH.WAIT = False


# ------------------------------------------------------------------------------------------------ #
# Validation
# ------------------------------------------------------------------------------------------------ #

LAUNCH_MODES = ("local", "slurm")
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
# Keys the sweep sets itself: each run's OUT_DIR, and auto-resume so a requeued job resumes
_OVERRIDES_PREFIX = "SETUP.OVERRIDES."
_BASE_PREFIX = "SETUP.BASE_CFG."
_C_DEFAULTS = _C.clone()


def _check_top(sc):
    _require(sc.NAME != "", "NAME", "the sweep needs a name (its folder under ROOT_DIR)")
    _require(
        _NAME_RE.match(sc.NAME) is not None,
        "NAME",
        f"{sc.NAME!r} may hold only letters, digits, '.', '-' and '_'",
    )
    _require(sc.ROOT_DIR != "", "ROOT_DIR", "set the folder that holds sweeps")
    _require(
        sc.NAME.strip(".") != "" and _is_inside(sc.ROOT_DIR, sc.NAME),
        "NAME",
        f"{sc.NAME!r} is not a folder inside ROOT_DIR; give a plain name such as my_sweep",
    )
    _require(
        sc.SETUP.BASE_CFG != "" or len(sc.SETUP.OVERRIDES) > 0,
        "SETUP.BASE_CFG",
        "name the base pycls config",
    )
    _require(
        sc.SETUP.BASE_CFG == "" or os.path.isfile(sc.SETUP.BASE_CFG),
        "SETUP.BASE_CFG",
        f"config file {sc.SETUP.BASE_CFG!r} does not exist",
    )
    _require(sc.SETUP.NUM_CONFIGS >= 0, "SETUP.NUM_CONFIGS", "must be >= 0")
    _require(sc.SETUP.MAX_DRAWS >= 0, "SETUP.MAX_DRAWS", "must be >= 0")
    _require(sc.SETUP.MAX_POINTS > 0, "SETUP.MAX_POINTS", "must be > 0")
    check_constraints(sc)


def _is_inside(root, name):
    """Whether ROOT_DIR/NAME is a folder strictly inside ROOT_DIR (no '..', no absolute name)."""
    root = os.path.normpath(os.path.abspath(root or "."))
    return os.path.dirname(os.path.normpath(os.path.join(root, name))) == root


def _check_launch(sc):
    la = sc.LAUNCH
    _require(la.MODE in LAUNCH_MODES, "LAUNCH.MODE", f"{la.MODE!r} is not one of {LAUNCH_MODES}")
    for key in ("NODES", "CPUS_PER_TASK", "TIME_LIMIT_MIN"):
        _require(la[key] > 0, f"LAUNCH.{key}", f"must be > 0, got {la[key]!r}")
    for key in ("MAX_PARALLEL", "GPUS_PER_NODE", "MEM_GB", "MAX_REQUEUE"):
        _require(la[key] >= 0, f"LAUNCH.{key}", f"must be >= 0, got {la[key]!r}")
    if la.MODE == "local":
        _require(la.NODES == 1, "LAUNCH.NODES", "local runs use this one machine (set 1)")


def _check_overrides(sc):
    for key, value in sc.SETUP.OVERRIDES.items():
        where = f"SETUP.OVERRIDES.{key}"
        default = check_pycls_key(where, key)
        sc.SETUP.OVERRIDES[key] = coerce_value(where, default, value)


def assert_sweep_cfg(sc):
    """Checks every key of a sweep config (samplers included); raises ConfigError naming it."""
    _check_top(sc)
    _check_launch(sc)
    _check_overrides(sc)
    validate_samplers(sc)


# ------------------------------------------------------------------------------------------------ #
# Loading
# ------------------------------------------------------------------------------------------------ #


def _bundled(path):
    """``path`` as it exists, else the config shipped with pycls of that name ("configs/...":
    pycls.config.resolve_cfg_file, so an installed wheel finds its own configs), else None."""
    if os.path.exists(path):
        return path
    try:
        return config.resolve_cfg_file(path)
    except ConfigError:
        return None


def _resolve_base_cfg(path):
    if not path or os.path.isabs(path):
        return os.path.abspath(path) if path else path
    return os.path.abspath(_bundled(path) or path)


def _merge_file(sc, path, base_pairs=()):
    path = _bundled(path) or path
    if not os.path.isfile(path):
        raise ConfigError(f"--sweep-cfg: sweep file {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    try:
        check_duplicate_keys(text, path, "--sweep-cfg")
        other = CfgNode.load_cfg(text)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--sweep-cfg: cannot parse {path}: {e}") from None
    if upstream_sweeps.is_upstream_sweep(other):
        other = upstream_sweeps.translate(other, base_pairs)
    elif base_pairs:
        key = base_pairs[0]
        raise ConfigError(
            f"{key}: only an upstream sweep file's inline SETUP.BASE_CFG takes overrides of its "
            f"keys; use SETUP.OVERRIDES.{key[len(_BASE_PREFIX) :]}"
        )
    _merge(sc.merge_from_other_cfg, other)


def _merge(fn, source):
    """Runs a yacs merge, turning its errors into a ConfigError naming the key."""
    try:
        fn(source)
    except KeyError as e:
        msg = str(e.args[0]) if e.args else str(e)
        raise _unknown_key(msg.split(":")[-1].strip()) from None
    except (ValueError, AssertionError) as e:
        msg = str(e)
        if "Non-existent key:" in msg:  # merge_from_list reports unknown keys this way
            raise _unknown_key(msg.split("Non-existent key:")[-1].strip()) from None
        key = msg.rsplit("config key:", 1)[-1].strip() if "config key:" in msg else "sweep"
        raise ConfigError(type_mismatch_in_words(key, msg) or f"{key}: wrong type or value ({msg})"
                          ) from None  # fmt: skip


def _unknown_key(key):
    hint = did_you_mean(key, dotted_keys(_C_DEFAULTS))
    return ConfigError(f"{key}: unknown sweep key{hint}; see pycls/sweep/sweep_file.py")


def _parse_literal(text):
    if not isinstance(text, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _merge_list(sc, overrides):
    """KEY VALUE pairs; SETUP.OVERRIDES.<dotted pycls key> VALUE adds or replaces an override."""
    overrides = list(overrides)
    if len(overrides) % 2:
        raise ConfigError(f"overrides: expected KEY VALUE pairs, got an odd list {overrides}")
    plain = []
    for key, value in zip(overrides[::2], overrides[1::2]):
        if key.startswith(_OVERRIDES_PREFIX):
            sc.SETUP.OVERRIDES[key[len(_OVERRIDES_PREFIX) :]] = _parse_literal(value)
        else:
            plain += [key, value]
    _merge(sc.merge_from_list, plain)


def load_sweep_cfg(path=None, overrides=(), validate=True):
    """Defaults <- sweep file <- KEY VALUE overrides, with absolute paths, validated and frozen."""
    sc = _C_DEFAULTS.clone()
    overrides = list(overrides)
    if len(overrides) % 2:
        raise ConfigError(f"overrides: expected KEY VALUE pairs, got an odd list {overrides}")
    # SETUP.BASE_CFG.<key> VALUE: a key of an upstream sweep file's inline base config
    pairs = list(zip(overrides[::2], overrides[1::2]))
    base_pairs = [x for k, v in pairs if k.startswith(_BASE_PREFIX) for x in (k, v)]
    overrides = [x for k, v in pairs if not k.startswith(_BASE_PREFIX) for x in (k, v)]
    if path:
        _merge_file(sc, path, base_pairs)
    elif base_pairs:
        raise ConfigError(f"{base_pairs[0]}: give the upstream sweep file with --sweep-cfg")
    _merge_list(sc, overrides)
    if sc.ROOT_DIR:
        sc.ROOT_DIR = os.path.abspath(os.path.expanduser(sc.ROOT_DIR))
    sc.SETUP.BASE_CFG = _resolve_base_cfg(os.path.expanduser(sc.SETUP.BASE_CFG))
    if validate:
        assert_sweep_cfg(sc)
    sc.freeze()
    return sc


# ------------------------------------------------------------------------------------------------ #
# Folder layout
# ------------------------------------------------------------------------------------------------ #


def sweep_dir(sc):
    return os.path.join(sc.ROOT_DIR, sc.NAME)


def cfgs_dir(sc):
    return os.path.join(sweep_dir(sc), "cfgs")


def logs_dir(sc):
    return os.path.join(sweep_dir(sc), "logs")


def launch_dir(sc):
    return os.path.join(sweep_dir(sc), "launch")


def analysis_dir(sc):
    return os.path.join(sweep_dir(sc), "analysis")


def sweep_json_path(sc):
    return os.path.join(sweep_dir(sc), "sweep.json")
