"""Upstream pycls's config files, read here: each of the 135 keys of facebookresearch/pycls's tree
is decided once in upstream_keys.yaml (docs/configs.md's table is rendered from it by
``markdown_table``): (a) ``renamed``: same meaning, another name or unit, translated at load time
with one log line per key written naming the key to write instead; (b) ``same``; (c) ``noted``:
accepted with a note (no effect here, or not reproduced); (d) ``refused``: values that cannot be
honoured stop the load naming the key, why, and what instead. Dumped configs hold our keys only.

A file that sets a key only upstream's tree has (every upstream model config sets NUM_GPUS) is an
upstream file: the keys it leaves out take upstream's defaults, and the keys both trees have with
another meaning (``dialect``: OPTIM.MIN_LR, a fraction of BASE_LR upstream, ...) are read as
upstream's, in the file and in the overrides given with it. Sources rank defaults < file <
overrides; within one source an upstream key and its translation set to different values is an
error naming both. pycls.config calls a ``Reader`` while it loads.
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

with open(os.path.join(os.path.dirname(__file__), "upstream_keys.yaml")) as _f:
    _TABLE = yaml.safe_load(_f)
UPSTREAM_DEFAULTS = {key: row[0] for key, row in _TABLE["keys"].items()}  # upstream's order
KEYS = {key: (row[1], row[2]) for key, row in _TABLE["keys"].items()}
DIALECT_KEYS, DEPRECATED = tuple(_TABLE["dialect"]), tuple(_TABLE["deprecated"])

# Where upstream finds its data sets (its docs/DATA.md: links in the package's datasets/data)
UPSTREAM_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "datasets", "data")
_EVAL_CROP_RATIO = 0.875  # our evaluation resizes to size / 0.875, then crops (datasets.transforms)

# Shared keys whose upstream values are not ours: upstream's by their value, in any file
_UPSTREAM_VALUES = {
    "TRAIN.DATASET": lambda v: v == "imagenet",
    "TEST.DATASET": lambda v: v == "imagenet",
    "TRAIN.AUGMENT": lambda v: v == "" or str(v).startswith(("AutoAugment", "RandAugment")),
}
# Upstream defaults an upstream file does not take: it always sets MODEL.TYPE and the data sets;
# OUT_DIR changes where a run writes, not what it does
_NO_DIALECT_DEFAULT = ("MODEL.TYPE", "TRAIN.DATASET", "TEST.DATASET", "TRAIN.AUGMENT", "OUT_DIR")


def _flat(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def _has(c, key):
    for part in key.split("."):
        if not isinstance(c, dict) or part not in c:
            return False
        c = c[part]
    return True


def _get(c, key):
    for part in key.split("."):
        c = c[part]
    return c


def _set(c, key, value, source):
    *parents, last = key.split(".")
    node = _get(c, ".".join(parents)) if parents else c
    default = node[last]
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        value = list(value)
    if type(value) is not type(default):
        name = type(default).__name__
        raise ConfigError(f"{source}: {value!r} is not a valid {key} (that key holds a {name})")
    node[last] = value


def _pop(node, key):
    """Removes a dotted key from a dict tree, and the sections it leaves empty."""
    head, _, rest = key.partition(".")
    if rest:
        _pop(node[head], rest)
        if not node[head]:
            node.pop(head)
    else:
        node.pop(head)


def _decode(text):
    """A value as yacs reads it: a Python literal, else the string."""
    try:
        return ast.literal_eval(text) if isinstance(text, str) else text
    except (ValueError, SyntaxError):
        return text


def _fmt(value):
    return f"{value:.10g}" if isinstance(value, float) else repr(value)


def _norm(value):
    return [_norm(x) for x in value] if isinstance(value, (list, tuple)) else value


# Translators: (v: upstream's values, its defaults in an upstream file; c: our config as merged;
# up: the key) -> ([(our key, value)], remark)


def _rename(v, c, up):
    return [(_TABLE["renames"][up], v[up])], ""


def _c_stem(v, c, up):
    # In one of our files only C_STEM_DIMS is upstream's: our kernels and strides plus the 1x1
    dims = v.get("VIT.C_STEM_DIMS", [*_get(c, "VIT.C_STEM_CHANNELS"), _get(c, "VIT.WIDTH")])
    kernels = v.get("VIT.C_STEM_KERNELS", [*_get(c, "VIT.C_STEM_KERNELS"), 1])
    strides = v.get("VIT.C_STEM_STRIDES", [*_get(c, "VIT.C_STEM_STRIDES"), 1])
    if _get(c, "VIT.STEM_TYPE") != "conv":
        return [], "no effect with VIT.STEM_TYPE patchify"
    if not len(dims) == len(kernels) == len(strides) >= 2 or (kernels[-1], strides[-1]) != (1, 1):
        raise ConfigError(
            f"{up}: the conv stem here ends in a 1x1 stride-1 conv to VIT.WIDTH: upstream's "
            "C_STEM_DIMS, C_STEM_KERNELS and C_STEM_STRIDES need one length >= 2 and a last "
            f"kernel and stride of 1, got {dims}, {kernels}, {strides}"
        )
    # Upstream builds every conv but the last as 3x3, whatever C_STEM_KERNELS lists for it
    pairs = [("VIT.C_STEM_CHANNELS", dims[:-1]), ("VIT.C_STEM_KERNELS", [3] * (len(dims) - 1))]
    return pairs + [("VIT.C_STEM_STRIDES", strides[:-1])], "the last conv is implied here"


def _betas(v, c, up):
    b1, b2 = _get(c, "OPTIM.BETAS")
    return [("OPTIM.BETAS", [v.get("OPTIM.BETA1", b1), v.get("OPTIM.BETA2", b2)])], ""


def _ema(v, c, up):
    alpha = v.get("OPTIM.EMA_ALPHA", UPSTREAM_DEFAULTS["OPTIM.EMA_ALPHA"])
    period = v.get("OPTIM.EMA_UPDATE_PERIOD", UPSTREAM_DEFAULTS["OPTIM.EMA_UPDATE_PERIOD"])
    if period <= 0:
        return [("TRAIN.EMA", False)], "upstream's period 0 keeps no EMA"
    # Upstream mixes `mix` of the weights into the average every `period` iterations, mix scaled
    # by the batch and the schedule's length; per optimizer step that is (1 - mix)^(1 / period)
    mix = min(1.0, alpha * _get(c, "TRAIN.BATCH_SIZE") / _get(c, "OPTIM.MAX_EPOCH") * period)
    pairs = [("TRAIN.EMA", True), ("TRAIN.EMA_PERIOD", int(period))]
    pairs += [("TRAIN.EMA_DECAY", (1.0 - mix) ** (1.0 / period)), ("TRAIN.EMA_WARMUP", False)]
    remark = f"each update mixes in {_fmt(mix)} of the weights, as upstream"
    if _get(c, "OPTIM.WARMUP_EPOCHS") > 0:
        remark += "; upstream copies the weights during warmup, here the average starts at init"
    return pairs, remark


_WD_KEYS = tuple(
    f"{p}{k}" for p in ("BN.", "LN.", "OPTIM.BIAS_") for k in ("USE_CUSTOM_", "CUSTOM_")
)
_WD_KEYS = tuple(f"{k}WEIGHT_DECAY" for k in _WD_KEYS)


def _no_decay_group(v, c, up):
    wd, is_vit = _get(c, "OPTIM.WEIGHT_DECAY"), _get(c, "MODEL.TYPE") == "vit"

    def custom(prefix):
        on, w = f"{prefix}USE_CUSTOM_WEIGHT_DECAY", f"{prefix}CUSTOM_WEIGHT_DECAY"
        return v.get(w, UPSTREAM_DEFAULTS[w]) if v.get(on, False) else wd

    # Upstream's groups: BN, LN, biases and the rest; ours: norms and biases vs the rest
    groups = ["LN."] if is_vit else []
    groups += ["BN."] if not is_vit or _get(c, "VIT.STEM_TYPE") == "conv" else []
    values = {f"{p}CUSTOM_WEIGHT_DECAY": custom(p) for p in [*groups, "OPTIM.BIAS_"]}
    if len(set(values.values())) > 1:
        given = ", ".join(f"{k} {_fmt(w)}" for k, w in values.items())
        raise ConfigError(
            f"{up}: norms and biases share one weight decay here (OPTIM."
            f"WEIGHT_DECAY_NO_DECAY_GROUP); this config gives them {given}: make them equal"
        )
    value = next(iter(values.values()))
    remark = ""
    if is_vit and value != wd:
        remark = "the position embedding and class token are in that group here (upstream "
        remark += f"decays them with OPTIM.WEIGHT_DECAY {_fmt(wd)})"
    return [("OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP", value)], remark


def _min_lr(v, c, up):
    base = _get(c, "OPTIM.BASE_LR")
    return [("OPTIM.MIN_LR", v[up] * base)], f"{_fmt(v[up])} x OPTIM.BASE_LR {_fmt(base)}"


def _steps(v, c, up):
    if v[up] and v[up][0] != 0:
        raise ConfigError(f"{up}: upstream's first step must be 0 (its own check), got {v[up]}")
    return [("OPTIM.STEPS", list(v[up][1:]))], "upstream's list starts with 0"


def _test_im_size(v, c, up):
    crop = _get(c, "TRAIN.IM_SIZE")
    if _get(c, "TEST.DATASET") != "imagefolder":  # CIFAR and the digits evaluate at the size
        return [("TEST.IM_SIZE", crop)], "evaluation at TRAIN.IM_SIZE, as upstream"
    resize = round(crop / _EVAL_CROP_RATIO)
    remark = f"evaluation resizes to {resize} and crops {crop}"
    return [("TEST.IM_SIZE", crop)], remark + (f" (upstream: {v[up]})" if v[up] != resize else "")


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
    if text in ("", "AutoAugment"):
        remark = "torchvision's ImageNet policy (upstream's: policy_v0)" if text else ""
        return [("TRAIN.AUTO_AUGMENT", "autoaugment" if text else "none")], remark
    name, *parts = text.split("_")
    params = {p[0]: p[1:] for p in parts}
    if name != "RandAugment" or set(params) - {"N", "M", "P"} or "M" not in params:
        raise ConfigError(f"{up}: {text!r} is not upstream's AutoAugment or RandAugment_N<n>_M<m>")
    if float(params.get("P", 1)) != 1:
        raise ConfigError(f"{up}: RandAugment's P (op probability) must be 1 here, got {text!r}")
    pairs = [
        ("TRAIN.AUTO_AUGMENT", "randaugment"),
        ("TRAIN.RAND_AUGMENT_N", int(params.get("N", 2))),
    ]
    pairs.append(("TRAIN.RAND_AUGMENT_M", round(30 * float(params["M"]))))
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
    pairs = [("NUM_PROCS", gpus)] if "NUM_GPUS" in v else []
    return [*pairs, ("TRAIN.PARALLEL", parallel)], ""


def _zoo_dir(v, c, up):
    if not _has(c, "MODEL.ZOO_DIR"):
        return [], "no effect until the model zoo's weights folder exists here"
    return [("MODEL.ZOO_DIR", v[up])], ""


# (upstream keys, translator), in the order they run (TEST.IM_SIZE after TEST.DATASET)
TRANSLATORS = [((k,), _rename) for k in _TABLE["renames"]] + [
    (("VIT.C_STEM_DIMS", "VIT.C_STEM_KERNELS", "VIT.C_STEM_STRIDES"), _c_stem),
    (("TRAIN.MIXED_PRECISION",), _amp),
    (("NUM_GPUS", "FSDP.ENABLED"), _parallel),
    (("OPTIM.BETA1", "OPTIM.BETA2"), _betas),
    (_WD_KEYS, _no_decay_group),
    (("TRAIN.DATASET",), _dataset),
    (("TEST.DATASET",), _dataset),
    (("TRAIN.AUGMENT",), _augment),
    (("TEST.IM_SIZE",), _test_im_size),
    (("OPTIM.MIN_LR",), _min_lr),
    (("OPTIM.STEPS",), _steps),
    (("OPTIM.EMA_ALPHA", "OPTIM.EMA_UPDATE_PERIOD"), _ema),
    (("DOWNLOAD_CACHE",), _zoo_dir),
]
# Not run for upstream's defaults: a file that leaves these out keeps ours
_ONLY_WRITTEN = ("TRAIN.DATASET", "TEST.DATASET", "TRAIN.AUGMENT", "DOWNLOAD_CACHE")


def sweep_launch(v):
    """Our sweep file's LAUNCH keys asking SLURM for what upstream's LAUNCH.* and NUM_GPUS asked
    submitit for (v: upstream's values, its defaults for what was not written)."""
    per_node = min(v["NUM_GPUS"], v["MAX_GPUS_PER_NODE"])
    nodes = max(1, -(-v["NUM_GPUS"] // v["MAX_GPUS_PER_NODE"]))
    same = {k: v[f"LAUNCH.{u}"] for k, u in _TABLE["sweep_launch"].items()}
    mem = v["LAUNCH.MEM_PER_GPU"] * per_node
    return {"MODE": "slurm", "NODES": nodes, "GPUS_PER_NODE": per_node, "MEM_GB": mem, **same}


def _check_value(key, value):
    """Stops at a value that cannot be honoured, before anything merges."""
    if not isinstance(value, str):  # every value refused is a name
        return
    accepted = _TABLE["accepted"].get(key)
    if accepted is not None and value not in accepted:
        raise ConfigError(f"{key}: {value!r} is not one of upstream's {accepted}")
    why = _TABLE["refused"].get(key, {}).get(value)
    if why:
        raise ConfigError(f"{key}: {value!r} cannot be honoured: {why}")


def _note(key, value):
    if key in DEPRECATED:
        return f"{key}: upstream pycls's deprecated key ({_fmt(value)}) is ignored, as there"
    return f"{key}: upstream pycls's key ({_fmt(value)}) is accepted: {KEYS[key][1]}"


def upstream_only(key, ours):
    """True for a key only upstream's tree has (it marks an upstream file). A key of the same
    meaning missing here (a model family not built here) is left to fail as unknown."""
    return key in DEPRECATED or (key in KEYS and KEYS[key][0] != SAME and not _has(ours, key))


class Reader:
    """Takes upstream's keys out of each source as the config loads (``take_file``,
    ``take_overrides`` return the rest for the ordinary merge), then writes their translations
    into the merged config (``apply``, which returns the log lines)."""

    def __init__(self):
        self.dialect, self.marker = False, ""  # the file is upstream's, and the key that says so
        self.written = {}  # upstream key -> (source: 0 file, 1 overrides; value)
        self.ours = {}  # our key written -> source

    def _taken(self, key, value, ours):
        _check_value(key, value)
        if upstream_only(key, ours):
            return True
        if key in DIALECT_KEYS:
            return self.dialect
        return key in _UPSTREAM_VALUES and _UPSTREAM_VALUES[key](value)

    def take_file(self, other, ours):
        """Removes upstream's keys from the loaded file (a dict tree); returns the rest."""
        items = list(_flat(other))
        markers = [k for k, _ in items if upstream_only(k, ours)]
        self.dialect, self.marker = bool(markers), (markers or [""])[0]
        for key, value in items:
            if self._taken(key, _decode(value), ours):
                self.written[key] = (0, _decode(value))
                _pop(other, key)
            else:
                self.ours[key] = 0
        return other

    def take_overrides(self, pairs, ours):
        """Removes upstream's KEY VALUE pairs from the (even) overrides; returns the rest."""
        rest = []
        for key, text in zip(pairs[::2], pairs[1::2]):
            if self._taken(key, _decode(text), ours):
                self.written[key] = (1, _decode(text))
            else:
                self.ours[key] = 1
                rest += [key, text]
        return rest

    def apply(self, c):
        """Writes the translations into ``c`` (merged from our keys); returns the log lines."""
        v = dict(UPSTREAM_DEFAULTS) if self.dialect else {}
        v.update({k: val for k, (_, val) in self.written.items()})
        if v.get("LAUNCH.MODE", "local") != "local":
            launch = " ".join(
                f"{k} {_fmt(x)}" for k, x in sweep_launch({**UPSTREAM_DEFAULTS, **v}).items()
            )
            raise ConfigError(
                f"LAUNCH.MODE: {v['LAUNCH.MODE']!r} submits the run through submitit upstream; "
                "run_net runs here. Submit it with tools/slurm/train.sbatch, or as a one-point "
                f"sweep file whose LAUNCH section is: {launch}"
            )
        lines = [self._dialect_defaults(c)] if self.dialect else []
        for key, (_, value) in self.written.items():
            if key in DEPRECATED or KEYS[key][0] in (NOTED, REFUSED):
                lines.append(_note(key, value))
        for triggers, fn in TRANSLATORS:
            lines += self._translate(c, v, triggers, fn)
        return lines + self._not_reproduced(c, v)

    def _translate(self, c, v, triggers, fn):
        written = [k for k in triggers if k in self.written]
        if not written and (not self.dialect or triggers[0] in _ONLY_WRITTEN):
            return []
        source = max((self.written[k][0] for k in written), default=None)
        pairs, remark = fn(v, c, written[0] if written else triggers[0])
        applied = []
        for key, value in pairs:
            if not self._ours_wins(c, key, value, source, written):
                _set(c, key, value, ", ".join(written) or triggers[0])
                applied.append(f"{key} {_fmt(_get(c, key))}")
        lines = []
        for key in written:
            line = f"{key}: upstream pycls's key ({_fmt(self.written[key][1])})"
            if not pairs:
                lines.append(f"{line} has no effect here ({remark})")
                continue
            said = ", ".join(applied) or "nothing (our spelling, given later, wins)"
            line += f" read as {said}; write {', '.join(k for k, _ in pairs)} instead"
            lines.append(line + (f" ({remark})" if remark else ""))
        return lines

    def _ours_wins(self, c, key, value, source, written):
        """True when our spelling, written in a later source, stands; raises for one source."""
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
            if KEYS[key][0] != SAME or key in _NO_DIALECT_DEFAULT or key in self.ours:
                continue
            if _has(c, key) and _norm(_get(c, key)) != _norm(value):
                _set(c, key, value, key)
                changed.append(f"{key} {_fmt(value)}")
        line = f"read as an upstream pycls config (it sets {self.marker})"
        return line + (
            f"; keys it leaves out take upstream's defaults: {', '.join(changed)}" * bool(changed)
        )

    def _not_reproduced(self, c, v):
        """Upstream defaults with an effect this code does not have, said once."""
        lines = []
        imagenet = _get(c, "TRAIN.DATASET") == "imagefolder"
        if self.dialect and "TRAIN.PCA_STD" not in self.written and v["TRAIN.PCA_STD"] and imagenet:
            lines.append(_note("TRAIN.PCA_STD", v["TRAIN.PCA_STD"]))
        return lines


def markdown_table():
    """Every upstream key, its kind and what it does here, as docs/configs.md shows it."""
    rows = ["| upstream key | here | what it does here |", "|---|---|---|"]
    rows += [f"| `{k}` | {KIND_LABEL[kind]} | {text} |" for k, (kind, text) in KEYS.items()]
    return "\n".join(rows)
