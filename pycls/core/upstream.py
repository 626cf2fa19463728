"""Upstream pycls's config files, read here: every key of facebookresearch/pycls's config tree.

A researcher brings YAML files written for Meta's pycls. Each of its 135 keys is decided once, in
the table ``KEYS`` below (rendered as the README's table by ``markdown_table``):

- ``SAME``: same key, same meaning; our config tree has it and nothing is done here.
- ``RENAMED``: same meaning under another name, or the same name with upstream's meaning (e.g.
  OPTIM.MIN_LR, a fraction of BASE_LR upstream): translated once at load time into our keys, one
  log line per key written naming the key to use instead. The dumped config holds only our keys.
- ``NOTED``: no effect here (or not reproduced here): accepted, one note per key written.
- ``REFUSED``: values that cannot be honoured stop the load with a ConfigError naming the key, why,
  and what to use instead (a key may be refused for some values and noted for others).

A file that sets a key only upstream's tree has (every upstream model config sets NUM_GPUS) is read
as an upstream file: the keys it leaves out take upstream's defaults (OPTIM.OPTIMIZER sgd, BASE_LR
0.1, MODEL.NUM_CLASSES 10, the EMA upstream always keeps, ...), and the keys whose meaning differs
(OPTIM.MIN_LR, OPTIM.STEPS, TEST.IM_SIZE, VIT.C_STEM_KERNELS/STRIDES) are read with upstream's
meaning, in the file and in the KEY VALUE overrides given with it. Our own files are untouched.

Precedence follows the sources: defaults < file < overrides. Within one source, an upstream key and
the key it translates to, both written with different values, is an error naming both; a later
source simply wins.

This module holds plain tables and small functions; pycls.core.config calls ``Reader`` while it
loads (it never imports the config module).
"""

import ast
import os

import yaml

from pycls.errors import ConfigError

SAME, RENAMED, NOTED, REFUSED = "same", "renamed", "noted", "refused"
KIND_LABEL = {
    RENAMED: "(a) translated",
    SAME: "(b) same",
    NOTED: "(c) noted",
    REFUSED: "(d) refused",
}

# Where upstream's data sets live by default (its docs/DATA.md: symlinks in the package)
UPSTREAM_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "datasets", "data")

# Our evaluation resizes to round(size / 0.875) before the centre crop (pycls.datasets.transforms)
_EVAL_CROP_RATIO = 0.875


def _table():
    with open(os.path.join(os.path.dirname(__file__), "upstream_keys.yaml")) as f:
        return yaml.safe_load(f)


# Every upstream key: its upstream default, and (kind, what it does here); plain data in
# upstream_keys.yaml, in upstream's order
UPSTREAM_DEFAULTS = {key: row[0] for key, row in _table().items()}
KEYS = {key: (row[1], row[2]) for key, row in _table().items()}

# Keys both trees have whose meaning differs: read with upstream's meaning in an upstream file
DIALECT_KEYS = ("OPTIM.MIN_LR", "OPTIM.STEPS", "TEST.IM_SIZE", "VIT.C_STEM_KERNELS")
DIALECT_KEYS += ("VIT.C_STEM_STRIDES", "TRAIN.DATASET", "TEST.DATASET")

# Keys both trees have whose upstream values are not ours: taken as upstream's by their value
_UPSTREAM_VALUES = {
    "TRAIN.DATASET": lambda v: v == "imagenet",
    "TEST.DATASET": lambda v: v == "imagenet",
    "TRAIN.AUGMENT": lambda v: v == "" or str(v).startswith(("AutoAugment", "RandAugment")),
}

# Values refused outright: key -> {value: why and what instead}
_REFUSED_VALUES = {
    "OPTIM.OPTIMIZER": {
        "adam": "upstream's adam couples weight decay into the gradient (L2); there is no such "
        "Adam here: use adamw (decoupled) or sgd",
    },
    "OPTIM.LR_POLICY": {
        "exp": "there is no exponential schedule here: use cos, lin or steps",
    },
}

# Shared keys whose upstream default an upstream file does not take (upstream's files always set
# MODEL.TYPE and the data sets; OUT_DIR's default changes where a run writes, not what it does)
_NO_DIALECT_DEFAULT = ("MODEL.TYPE", "TRAIN.DATASET", "TEST.DATASET", "TRAIN.AUGMENT", "OUT_DIR")


# ------------------------------------------------------------------------------------------------ #
# Small helpers over nested config nodes and dotted keys
# ------------------------------------------------------------------------------------------------ #


def _flat(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _has(c, key):
    node = c
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _get(c, key):
    node = c
    for part in key.split("."):
        node = node[part]
    return node


def _set(c, key, value, source):
    *parents, last = key.split(".")
    node = c
    for part in parents:
        node = node[part]
    default = node[last]
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        value = list(value)
    if type(value) is not type(default):
        raise ConfigError(
            f"{source}: {value!r} is not a valid {key} (that key holds a {type(default).__name__})"
        )
    node[last] = value


def _pop(node, key):
    *parents, last = key.split(".")
    chain = [node]
    for part in parents:
        chain.append(chain[-1][part])
    value = chain[-1].pop(last)
    for parent, part in zip(reversed(chain[:-1]), reversed(parents)):
        if not parent[part]:
            parent.pop(part)  # an emptied section (e.g. LAUNCH) would be an unknown key
    return value


def _decode(text):
    """A KEY VALUE override's value as yacs reads it (a Python literal, else the string)."""
    if not isinstance(text, str):
        return text
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.10g}"
    return repr(value) if isinstance(value, str) else str(value)


# ------------------------------------------------------------------------------------------------ #
# Translators: upstream values (v, with upstream's defaults for what was not written) and our
# config as loaded so far (c) -> our (key, value) pairs and an optional remark
# ------------------------------------------------------------------------------------------------ #


def _rename(ours):
    return lambda v, c, up: ([(ours, v[up])], "")


def _c_stem(v, c, up):
    # In one of our files only C_STEM_DIMS is upstream's: our kernels and strides plus the 1x1
    dims = v.get("VIT.C_STEM_DIMS", [*_get(c, "VIT.C_STEM_CHANNELS"), _get(c, "VIT.WIDTH")])
    kernels = v.get("VIT.C_STEM_KERNELS", [*_get(c, "VIT.C_STEM_KERNELS"), 1])
    strides = v.get("VIT.C_STEM_STRIDES", [*_get(c, "VIT.C_STEM_STRIDES"), 1])
    if _get(c, "VIT.STEM_TYPE") != "conv":
        return [], "no effect with VIT.STEM_TYPE patchify"
    if not (len(dims) == len(kernels) == len(strides) >= 2):
        raise ConfigError(
            f"{up}: upstream's conv stem needs VIT.C_STEM_DIMS, C_STEM_KERNELS and C_STEM_STRIDES "
            f"of one length >= 2 (the last entry is the final conv), got {dims}, {kernels}, "
            f"{strides}"
        )
    if kernels[-1] != 1 or strides[-1] != 1:
        raise ConfigError(
            f"{up}: the conv stem here ends in a 1x1 stride-1 conv to VIT.WIDTH; upstream's last "
            f"kernel {kernels[-1]} / stride {strides[-1]} cannot be built: use 1 and 1"
        )
    # Upstream builds every conv but the last as 3x3, whatever C_STEM_KERNELS lists for it
    pairs = [("VIT.C_STEM_CHANNELS", dims[:-1]), ("VIT.C_STEM_KERNELS", [3] * (len(dims) - 1))]
    pairs.append(("VIT.C_STEM_STRIDES", strides[:-1]))
    return pairs, "the last conv of upstream's lists is the 1x1 to VIT.WIDTH, added here"


def _betas(v, c, up):
    b1, b2 = _get(c, "OPTIM.BETAS")
    return [("OPTIM.BETAS", [v.get("OPTIM.BETA1", b1), v.get("OPTIM.BETA2", b2)])], ""


def _ema(v, c, up):
    alpha = v.get("OPTIM.EMA_ALPHA", UPSTREAM_DEFAULTS["OPTIM.EMA_ALPHA"])
    period = v.get("OPTIM.EMA_UPDATE_PERIOD", UPSTREAM_DEFAULTS["OPTIM.EMA_UPDATE_PERIOD"])
    if period <= 0:
        return [("TRAIN.EMA", False)], "upstream's period 0 keeps no EMA"
    batch, epochs = _get(c, "TRAIN.BATCH_SIZE"), _get(c, "OPTIM.MAX_EPOCH")
    # Upstream mixes alpha x (weights) into the average every `period` iterations, alpha scaled
    # by the batch and the schedule length; one mix is (1 - alpha), so per step (1 - alpha)^(1/p)
    mix = min(1.0, alpha * batch / epochs * period)
    decay = (1.0 - mix) ** (1.0 / period)
    pairs = [("TRAIN.EMA", True), ("TRAIN.EMA_PERIOD", int(period)), ("TRAIN.EMA_DECAY", decay)]
    pairs.append(("TRAIN.EMA_WARMUP", False))
    remark = f"each update mixes in {_fmt(mix)} of the weights, as upstream"
    if _get(c, "OPTIM.WARMUP_EPOCHS") > 0:
        remark += (
            "; upstream copies the weights during the warmup epochs, here the average starts "
            "from the initial weights"
        )
    return pairs, remark


def _no_decay_group(v, c, up):
    wd = _get(c, "OPTIM.WEIGHT_DECAY")

    def custom(prefix):
        on, w = (f"{prefix}USE_CUSTOM_WEIGHT_DECAY", f"{prefix}CUSTOM_WEIGHT_DECAY")
        return v.get(w, UPSTREAM_DEFAULTS[w]) if v.get(on, False) else wd

    is_vit = _get(c, "MODEL.TYPE") == "vit"
    norms = {"LN.": custom("LN.")} if is_vit else {}
    if not is_vit or _get(c, "VIT.STEM_TYPE") == "conv":
        norms["BN."] = custom("BN.")
    values = {**{f"{p}CUSTOM_WEIGHT_DECAY": w for p, w in norms.items()}}
    values["OPTIM.BIAS_CUSTOM_WEIGHT_DECAY"] = custom("OPTIM.BIAS_")
    if len(set(values.values())) > 1:
        raise ConfigError(
            f"{up}: norms and biases share one weight decay here "
            f"(OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP), but this config gives them "
            + ", ".join(f"{k.replace('CUSTOM_', '')} {_fmt(w)}" for k, w in values.items())
            + ": make them equal"
        )
    value = next(iter(values.values()))
    remark = ""
    if is_vit and value != wd:
        remark = (
            "the position embedding and class token are in that group here (upstream decays "
            f"them with OPTIM.WEIGHT_DECAY {_fmt(wd)})"
        )
    return [("OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP", value)], remark


def _min_lr(v, c, up):
    base = _get(c, "OPTIM.BASE_LR")
    return [("OPTIM.MIN_LR", v[up] * base)], f"{_fmt(v[up])} x OPTIM.BASE_LR {_fmt(base)}"


def _steps(v, c, up):
    steps = list(v[up])
    if steps and steps[0] != 0:
        raise ConfigError(f"{up}: upstream's first step must be 0 (its own check), got {steps}")
    return [("OPTIM.STEPS", steps[1:])], "upstream's list starts with 0, ours with the first drop"


def _test_im_size(v, c, up):
    crop = _get(c, "TRAIN.IM_SIZE")
    if _get(c, "TEST.DATASET") != "imagefolder":  # CIFAR and the digits evaluate at the size
        return [("TEST.IM_SIZE", crop)], "evaluation at TRAIN.IM_SIZE, as upstream"
    resize = round(crop / _EVAL_CROP_RATIO)
    remark = f"evaluation resizes to {resize} and crops {crop}"
    if v[up] != resize:
        remark += f" (upstream resized to {v[up]})"
    return [("TEST.IM_SIZE", crop)], remark


def _dataset(v, c, up):
    name = v[up]
    if name not in ("imagenet", "cifar10"):  # one of ours (e.g. digits given as an override)
        return [(up, name)], ""
    pairs = [(up, "imagefolder" if name == "imagenet" else name)]
    if not _get(c, "DATA.PATH"):
        pairs.append(("DATA.PATH", os.path.join(UPSTREAM_DATA_DIR, name)))
    return pairs, ""


def _augment(v, c, up):
    text = v[up]
    if text == "":
        return [("TRAIN.AUTO_AUGMENT", "none")], ""
    if text == "AutoAugment":
        remark = "torchvision's ImageNet policy (upstream: the EfficientNet policy_v0)"
        return [("TRAIN.AUTO_AUGMENT", "autoaugment")], remark
    parts = text.split("_")
    params = {p[0]: p[1:] for p in parts[1:]}
    if parts[0] != "RandAugment" or set(params) - {"N", "M", "P"} or "M" not in params:
        raise ConfigError(
            f"{up}: {text!r} is not one of upstream's AutoAugment, RandAugment_N<n>_M<m>"
        )
    if float(params.get("P", 1)) != 1:
        raise ConfigError(f"{up}: RandAugment's P (op probability) must be 1 here, got {text!r}")
    n, m = int(float(params.get("N", 2))), float(params["M"])
    pairs = [("TRAIN.AUTO_AUGMENT", "randaugment"), ("TRAIN.RAND_AUGMENT_N", n)]
    pairs.append(("TRAIN.RAND_AUGMENT_M", round(30 * m)))
    return pairs, "upstream's magnitude in [0, 1] x 30 (torchvision's RandAugment ops)"


def _amp(v, c, up):
    if v[up]:
        return [("AMP.LEVEL", "O1"), ("AMP.DTYPE", "float16")], "autocast + loss scaling"
    return [("AMP.LEVEL", "O0")], ""


def _parallel(v, c, up):
    gpus = int(v.get("NUM_GPUS", _get(c, "NUM_PROCS")))
    if "FSDP.ENABLED" in v:  # upstream: FSDP when enabled, else DDP on more than one GPU
        parallel = "fsdp" if v["FSDP.ENABLED"] else "ddp" if gpus > 1 else "none"
    else:  # NUM_GPUS alone in one of our files: keep its engine, DDP rather than none
        current = _get(c, "TRAIN.PARALLEL")
        parallel = "ddp" if gpus > 1 and current == "none" else current
    pairs = [("TRAIN.PARALLEL", parallel)]
    return ([("NUM_PROCS", gpus)] if "NUM_GPUS" in v else []) + pairs, ""


def _zoo_dir(v, c, up):
    if not _has(c, "MODEL.ZOO_DIR"):
        return [], "no effect until the model zoo's weights folder exists here"
    return [("MODEL.ZOO_DIR", v[up])], ""


# (trigger keys, translator); one translator may read several upstream keys
TRANSLATORS = [
    (("VIT.NUM_LAYERS",), _rename("VIT.DEPTH")),
    (("VIT.HIDDEN_DIM",), _rename("VIT.WIDTH")),
    (("VIT.CLASSIFIER_TYPE",), _rename("VIT.CLASSIFIER")),
    (("VIT.C_STEM_DIMS", "VIT.C_STEM_KERNELS", "VIT.C_STEM_STRIDES"), _c_stem),
    (("LN.EPS",), _rename("VIT.NORM_EPS")),
    (("FSDP.RESHARD_AFTER_FW",), _rename("FSDP.RESHARD_AFTER_FORWARD")),
    (("TRAIN.MIXUP_ALPHA",), _rename("MIXUP.ALPHA")),
    (("TRAIN.CUTMIX_ALPHA",), _rename("MIXUP.CUTMIX_ALPHA")),
    (("TRAIN.MIXED_PRECISION",), _amp),
    (("NUM_GPUS", "FSDP.ENABLED"), _parallel),
    (("OPTIM.BETA1", "OPTIM.BETA2"), _betas),
    (
        (
            "BN.USE_CUSTOM_WEIGHT_DECAY",
            "BN.CUSTOM_WEIGHT_DECAY",
            "LN.USE_CUSTOM_WEIGHT_DECAY",
            "LN.CUSTOM_WEIGHT_DECAY",
            "OPTIM.BIAS_USE_CUSTOM_WEIGHT_DECAY",
            "OPTIM.BIAS_CUSTOM_WEIGHT_DECAY",
        ),
        _no_decay_group,
    ),
    (("TRAIN.DATASET",), _dataset),
    (("TEST.DATASET",), _dataset),
    (("TRAIN.AUGMENT",), _augment),
    (("TEST.IM_SIZE",), _test_im_size),
    (("OPTIM.MIN_LR",), _min_lr),
    (("OPTIM.STEPS",), _steps),
    (("OPTIM.EMA_ALPHA", "OPTIM.EMA_UPDATE_PERIOD"), _ema),
    (("DOWNLOAD_CACHE",), _zoo_dir),
]

# Translators not run for upstream's defaults: a file that leaves these out keeps ours
_ONLY_WRITTEN = ("TRAIN.DATASET", "TEST.DATASET", "TRAIN.AUGMENT", "DOWNLOAD_CACHE")


# ------------------------------------------------------------------------------------------------ #
# Notes and refusals
# ------------------------------------------------------------------------------------------------ #


def _launch_mode(value):
    if value in ("local", "slurm", "submitit_local"):  # slurm: refused in Reader.apply
        return "runs start here (NUM_PROCS local processes, or torchrun / srun)"
    raise ConfigError(f"LAUNCH.MODE: {value!r} is not one of upstream's local, slurm")


def sweep_launch(v):
    """Our sweep file's LAUNCH keys that ask SLURM for what upstream's LAUNCH.* and NUM_GPUS
    asked submitit for (v: upstream's values, its defaults for what was not written)."""
    per_node = min(v["NUM_GPUS"], v["MAX_GPUS_PER_NODE"])
    return {
        "MODE": "slurm",
        "PARTITION": v["LAUNCH.PARTITION"],
        "NODES": max(1, -(-v["NUM_GPUS"] // v["MAX_GPUS_PER_NODE"])),
        "GPUS_PER_NODE": per_node,
        "CPUS_PER_TASK": v["LAUNCH.CPUS_PER_GPU"],
        "MEM_GB": v["LAUNCH.MEM_PER_GPU"] * per_node,
        "TIME_LIMIT_MIN": v["LAUNCH.TIME_LIMIT"],
        "MAX_REQUEUE": v["LAUNCH.MAX_RETRY"],
        "COMMENT": v["LAUNCH.COMMENT"],
        "CONSTRAINT": v["LAUNCH.GPU_TYPE"],
    }


def _refuse_submission(v):
    launch = " ".join(f"{k} {_fmt(val)}" for k, val in sweep_launch(v).items())
    raise ConfigError(
        f"LAUNCH.MODE: {v['LAUNCH.MODE']!r} submits the run through submitit upstream; run_net "
        "runs here. Submit it with tools/slurm/train.sbatch, or as a one-point sweep file whose "
        f"LAUNCH section is: {launch}"
    )


def _loader_mode(value):
    if value == "pytorch":
        return "the torch DataLoader is the only loader here"
    raise ConfigError(
        f"DATA_LOADER.MODE: {value!r} (FFCV) is not supported here; prepare shards once with "
        "tools/prepare_dataset.py and use DATA_LOADER.BACKEND shards DATA_LOADER.SHARD_PATH DIR"
    )


def _dist_backend(value):
    if value in ("nccl", "gloo"):
        return "the backend follows the device: nccl on CUDA, gloo on CPU"
    raise ConfigError(f"DIST_BACKEND: {value!r} is not available: nccl or gloo (chosen by DEVICE)")


_NOTE_FUNCTIONS = {
    "LAUNCH.MODE": _launch_mode,
    "DATA_LOADER.MODE": _loader_mode,
    "DIST_BACKEND": _dist_backend,
}


def _note(key, value):
    if key in DEPRECATED:
        return (
            f"{key}: upstream pycls's deprecated key ({_fmt(value)}) is ignored, as upstream does"
        )
    if key in _NOTE_FUNCTIONS:
        text = _NOTE_FUNCTIONS[key](value)
    else:
        text = KEYS[key][1]
    return f"{key}: upstream pycls's key ({_fmt(value)}) is accepted: {text}"


# ------------------------------------------------------------------------------------------------ #
# The reader one load uses
# ------------------------------------------------------------------------------------------------ #


# Keys upstream still accepts and ignores (its register_deprecated_key list; TRAIN.EVAL_PERIOD and
# TRAIN.CHECKPOINT_PERIOD, deprecated there too, are ours and honoured here)
DEPRECATED = ("MEM", "MEM.RELU_INPLACE", "OPTIM.GAMMA", "PREC_TIME.BATCH_SIZE")
DEPRECATED += ("PREC_TIME.ENABLED", "PORT")


def upstream_only(key, ours):
    """True for a key only upstream's tree has (its presence marks an upstream file). A key of
    the same meaning missing here (a model family not built here) is left to fail as unknown."""
    if key in DEPRECATED:
        return True
    return key in KEYS and KEYS[key][0] != SAME and not _has(ours, key)


class Reader:
    """Takes upstream's keys out of each source as the config loads, and puts them back as ours.

    ``take_file`` and ``take_overrides`` return what is left for the ordinary merge; ``apply``
    then writes the translations into the merged config and returns the log lines.
    """

    def __init__(self):
        self.dialect = False  # the file is upstream's
        self.marker = ""
        self.written = {}  # upstream key -> (source index, value)
        self.ours = {}  # our key written -> source index
        self.lines = []

    def _taken(self, key, value, ours):
        if key in _REFUSED_VALUES and value in _REFUSED_VALUES[key]:
            raise ConfigError(f"{key}: {value!r} cannot be honoured: {_REFUSED_VALUES[key][value]}")
        if key in _NOTE_FUNCTIONS:
            _NOTE_FUNCTIONS[key](value)  # a refused value stops here, before anything merges
        if upstream_only(key, ours):
            return True
        if key in DIALECT_KEYS:
            return self.dialect
        return key in _UPSTREAM_VALUES and _UPSTREAM_VALUES[key](value)

    def take_file(self, other, ours):
        """Removes upstream's keys from the loaded file (a dict tree); returns the rest."""
        items = list(_flat(other))
        markers = [k for k, _ in items if upstream_only(k, ours)]
        self.dialect = bool(markers)
        self.marker = markers[0] if markers else ""
        for key, value in items:
            if self._taken(key, _decode(value), ours):
                self.written[key] = (0, _decode(value))
                _pop(other, key)
            else:
                self.ours[key] = 0
        return other

    def take_overrides(self, pairs, ours):
        """Removes upstream's KEY VALUE pairs from the overrides; returns the rest."""
        rest = []
        for i in range(0, len(pairs) - 1, 2):
            key, text = pairs[i], pairs[i + 1]
            if self._taken(key, _decode(text), ours):
                self.written[key] = (1, _decode(text))
            else:
                self.ours[key] = 1
                rest += [key, text]
        return rest + list(pairs[len(pairs) - len(pairs) % 2 :])

    def apply(self, c):
        """Writes the translations into ``c`` (merged from our keys); returns the log lines."""
        v = dict(UPSTREAM_DEFAULTS) if self.dialect else {}
        v.update({k: val for k, (_, val) in self.written.items()})
        if v.get("LAUNCH.MODE", "local") != "local":
            _refuse_submission({**UPSTREAM_DEFAULTS, **v})
        lines = []
        if self.dialect:
            lines.append(self._dialect_defaults(c))
        for key, (_, value) in self.written.items():
            if key in DEPRECATED or KEYS[key][0] in (NOTED, REFUSED):
                lines.append(_note(key, value))
        for triggers, fn in TRANSLATORS:
            lines += self._translate(c, v, triggers, fn)
        lines += self._not_reproduced(c, v)
        self.lines = [line for line in lines if line]
        return self.lines

    def _translate(self, c, v, triggers, fn):
        written = [k for k in triggers if k in self.written]
        if not written and (not self.dialect or triggers[0] in _ONLY_WRITTEN):
            return []
        source = max((self.written[k][0] for k in written), default=None)
        pairs, remark = fn(v, c, written[0] if written else triggers[0])
        applied = []
        for key, value in pairs:
            if self._conflict(c, key, value, source, written):
                continue
            _set(c, key, value, ", ".join(written) or triggers[0])
            applied.append(f"{key} {_fmt(_get(c, key))}")
        lines = []
        for key in written:
            line = f"{key}: upstream pycls's key ({_fmt(self.written[key][1])})"
            if not pairs:
                lines.append(f"{line} has no effect here ({remark})")
                continue
            said = ", ".join(applied) if applied else "nothing (our spelling, given later, wins)"
            line += f" read as {said}; write {', '.join(k for k, _ in pairs)} instead"
            lines.append(line + (f" ({remark})" if remark else ""))
        return lines

    def _conflict(self, c, key, value, source, written):
        """True when our spelling, written in a later source, wins; raises for one source."""
        if key not in self.ours:
            return False
        if source is None or self.ours[key] > source:
            return True  # upstream's default, or our key given later: ours stands
        if self.ours[key] == source and _norm(_get(c, key)) != _norm(value):
            where = "the config file" if source == 0 else "the overrides"
            raise ConfigError(
                f"{key}: {' / '.join(written)} (upstream's spelling) and {key} both set in "
                f"{where}, to {_fmt(_norm(value))} and {_fmt(_norm(_get(c, key)))}; keep one"
            )
        return False

    def _dialect_defaults(self, c):
        changed = []
        for key, value in UPSTREAM_DEFAULTS.items():
            if KEYS[key][0] != SAME or key in _NO_DIALECT_DEFAULT or not _has(c, key):
                continue
            if key in self.ours or _norm(_get(c, key)) == _norm(value):
                continue
            _set(c, key, value, key)
            changed.append(f"{key} {_fmt(value)}")
        line = f"read as an upstream pycls config (it sets {self.marker})"
        if changed:
            line += "; keys it leaves out take upstream's defaults: " + ", ".join(changed)
        return line

    def _not_reproduced(self, c, v):
        """Upstream defaults with an effect this code does not have, said once."""
        if not self.dialect:
            return []
        lines = []
        trains_imagenet = _get(c, "TRAIN.DATASET") == "imagefolder"
        if "TRAIN.PCA_STD" not in self.written and v["TRAIN.PCA_STD"] > 0 and trains_imagenet:
            lines.append(_note("TRAIN.PCA_STD", v["TRAIN.PCA_STD"]))
        uses_bn = _get(c, "MODEL.TYPE") != "vit" or _get(c, "VIT.STEM_TYPE") == "conv"
        if "BN.USE_PRECISE_STATS" not in self.written and v["BN.USE_PRECISE_STATS"] and uses_bn:
            lines.append(_note("BN.USE_PRECISE_STATS", True))
        return lines


def _norm(value):
    return [_norm(x) for x in value] if isinstance(value, (list, tuple)) else value


# ------------------------------------------------------------------------------------------------ #
# The README's table
# ------------------------------------------------------------------------------------------------ #


def markdown_table():
    """Every upstream key, its kind and what it does here, as the README shows it."""
    rows = ["| upstream key | here | what it does here |", "|---|---|---|"]
    for key in UPSTREAM_DEFAULTS:
        kind, text = KEYS[key]
        rows.append(f"| `{key}` | {KIND_LABEL[kind]} | {text} |")
    return "\n".join(rows)
