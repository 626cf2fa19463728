"""Sweep setup: one full, validated pycls config per point in ROOT_DIR/NAME/cfgs/NNNN.yaml.

Every point is resolved exactly as ``tools/run_net.py`` would resolve it (base config <- fixed
overrides <- the point's values <- its own OUT_DIR, with TRAIN.AUTO_RESUME on) and validated by
``pycls.config.load_cfg``, so an impossible point stops the setup, naming the key, before a
single file is written. Setting up again is safe: identical configs are left alone and new points
(a larger NUM_CONFIGS with the same seed) are appended, but a folder holding a different sweep is
refused.
"""

import os
import shlex

from pycls import config
from pycls.config import ConfigError
from pycls.core import builders
from pycls.distributed.preflight import check_launch
from pycls.sweep import cli
from pycls.sweep.commands import step_command
from pycls.sweep.constraints import violation
from pycls.sweep.runs import SweepError
from pycls.sweep.samplers import sample_points
from pycls.sweep.submit import num_tasks
from pycls.sweep.sweep_file import cfgs_dir, logs_dir, sweep_dir


def describe_point(point):
    return ", ".join(f"{k}={v}" for k, v in point.items())


def _resolve(sc, name, point):
    """The validated pycls config of one point."""
    opts = []
    for key, value in list(sc.SETUP.OVERRIDES.items()) + list(point.items()):
        opts += [key, value]
    opts += ["OUT_DIR", os.path.join(logs_dir(sc), name), "TRAIN.AUTO_RESUME", True]
    where = f"(sweep point {name}: {describe_point(point)})"
    try:
        cfg = config.load_cfg(sc.SETUP.BASE_CFG or None, opts, for_this_machine=False)
        _check_processes(sc, cfg)
    except ConfigError as e:
        raise ConfigError(f"{e} {where}") from None
    for key, value in point.items():
        resolved = config.get(cfg, key)
        if _differs(resolved, value):
            raise ConfigError(
                f"SETUP.SAMPLERS.{key}: resolving the config changed {value!r} to {resolved!r} "
                f"{where}"
            )
    return cfg


def _check_processes(sc, cfg):
    """On SLURM each GPU is one training process; the run must use them together."""

    n = num_tasks(sc)
    if n == 1:
        return
    if cfg.TRAIN.PARALLEL == "none":
        raise ConfigError(
            f"TRAIN.PARALLEL: 'none' would train {n} independent copies in the {n} processes "
            "SLURM starts per run (LAUNCH.NODES x LAUNCH.GPUS_PER_NODE); use ddp or fsdp"
        )
    # settings that depend on the number of processes (pipeline stages, ...)
    check_launch(builders.launch_settings(cfg), n)


def _differs(resolved, value):
    if isinstance(value, (list, tuple)):
        return list(resolved) != list(value)
    return resolved != value


def _has_constraints(sc):
    cons = sc.SETUP.CONSTRAINTS
    ranges = [cons.CX[k] for k in cons.CX] + [cons.REGNET.NUM_STAGES]
    return any(list(r) != [0, 0] for r in ranges)


def _meets_constraints(sc):
    """accept(point) for sample_points: resolves the point's config and checks it."""

    def accept(point):
        return violation(sc, _resolve(sc, "constraints", point)) is None

    return accept if _has_constraints(sc) else None


def build_run_cfgs(sc):
    """[(name, point, cfg)] for every point of the sweep, all validated."""
    points = sample_points(sc, _meets_constraints(sc))
    width = max(4, len(str(len(points) - 1)))
    runs = []
    for i, point in enumerate(points):
        name = f"{i:0{width}d}"
        runs.append((name, point, _resolve(sc, name, point)))
    return runs


def _cfg_text(sc, name, point, cfg):
    return f"# sweep {sc.NAME}, point {name}: {describe_point(point)}\n{cfg.dump()}"


def _check_existing(folder, texts):
    """Refuses to overwrite configs of a different sweep (appending new points is fine)."""
    if not os.path.isdir(folder):
        return
    for file in sorted(os.listdir(folder)):
        name, ext = os.path.splitext(file)
        if ext != ".yaml":
            continue
        with open(os.path.join(folder, file)) as f:
            same = texts.get(name) == f.read()
        if not same:
            raise SweepError(
                f"{os.path.join(folder, file)} differs from this sweep's point {name}: the folder "
                f"holds a different sweep. Pick another NAME or delete {os.path.dirname(folder)}"
            )


def setup_sweep(sc):
    """Writes sweep.yaml and cfgs/NNNN.yaml; returns [(name, point, cfg)]."""
    runs = build_run_cfgs(sc)
    texts = {name: _cfg_text(sc, name, point, cfg) for name, point, cfg in runs}
    _check_existing(cfgs_dir(sc), texts)
    os.makedirs(cfgs_dir(sc), exist_ok=True)
    with open(os.path.join(sweep_dir(sc), "sweep.yaml"), "w") as f:
        f.write(sc.dump())
    for name, text in texts.items():
        with open(os.path.join(cfgs_dir(sc), f"{name}.yaml"), "w") as f:
            f.write(text)
    return runs


def _run(sc, args):
    runs = setup_sweep(sc)
    print(f"sweep {sc.NAME}: {len(runs)} run configs in {cfgs_dir(sc)}")
    for name, point, _ in runs:
        print(f"  {name}  {describe_point(point)}")
    same = shlex.join(["--sweep-cfg", args.sweep_cfg, *args.opts])  # every step the same
    print(f"next: {step_command('launch')} {same}")
    return 0


def main(argv=None, prog=None):
    return cli.run_tool("Write one pycls config per point of a sweep.", _run, argv, prog=prog)
