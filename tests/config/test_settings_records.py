"""The keys the settings records generate (``pycls.config.records``) give each record the
arguments the hand-written rows gave: the same keys read for each argument (``HAND_ROWS``, the rows
as they were written before the keys were generated, the engine's name reading FSDP.BACKEND
always where the hand-written row read it only under fsdp), and the same values for the configs
in configs/."""

import glob
import os

import pytest

from pycls.config import ConfigError, get_default_cfg, read_cfg
from pycls.config.sections import amp, engine, optimization
from pycls.config.sections.key_checks import keys_read
from pycls.distributed.launch_settings import LaunchSettings
from pycls.engines.settings import (
    AmpSettings,
    DDPSettings,
    EngineSettings,
    FSDPSettings,
    MeshSettings,
    PipelineSettings,
)
from pycls.optim.optimizer_options import LRScheduleSettings, OptimizerSettings
from tests.helpers import ROOT

HAND_ROWS = {
    "ENGINE_SETTINGS": {
        "engine": ("FSDP.BACKEND", "TRAIN.PARALLEL"),
        "compile": ("TRAIN.COMPILE",),
        "compile_scope": ("TRAIN.COMPILE_SCOPE",),
        "compile_mode": ("TRAIN.COMPILE_MODE",),
        "compile_coordinate_descent": ("TRAIN.COMPILE_COORDINATE_DESCENT",),
        "reduce_in_compute_dtype": ("AMP.REDUCE_DTYPE",),
        "sync_batch_norm": ("BN.SYNC",),
        "float8": ("AMP.FLOAT8",),
        "float8_min_dim": ("AMP.FLOAT8_MIN_DIM",),
        "float8_layers": ("AMP.FLOAT8_LAYERS",),
    },
    "DDP_SETTINGS": {
        "bucket_cap_mb": ("DDP.BUCKET_CAP_MB",),
        "gradient_as_bucket_view": ("DDP.GRADIENT_AS_BUCKET_VIEW",),
        "static_graph": ("DDP.STATIC_GRAPH",),
        "find_unused_parameters": ("DDP.FIND_UNUSED_PARAMETERS",),
    },
    "FSDP_SETTINGS": {
        "reshard_after_forward": ("FSDP.RESHARD_AFTER_FORWARD",),
        "cpu_offload": ("FSDP.CPU_OFFLOAD",),
    },
    "PIPELINE_SETTINGS": {
        "stages": ("PIPELINE.STAGES",),
        "stages_per_rank": ("PIPELINE.STAGES_PER_RANK",),
        "balance": ("PIPELINE.BALANCE",),
        "micro_batches": ("PIPELINE.MICRO_BATCHES",),
        "schedule": ("PIPELINE.SCHEDULE",),
    },
    "MESH_SETTINGS": {
        "dp": ("MESH.DP",),
        "dp_replicate": ("MESH.DP_REPLICATE",),
        "tp": ("MESH.TP",),
        "pp": ("MESH.PP",),
        "batch_size": ("TRAIN.BATCH_SIZE",),
        "accum_steps": ("TRAIN.ACCUM_STEPS",),
    },
    "LAUNCH_SETTINGS": {
        "num_procs": ("NUM_PROCS",),
        "cpu_threads": ("CPU_THREADS",),
        "device": ("DEVICE",),
        "engine": ("FSDP.BACKEND", "TRAIN.PARALLEL"),
        "cpu_collectives": ("FSDP.BACKEND", "FSDP.CPU_OFFLOAD", "TRAIN.PARALLEL"),
        "depth": ("VIT.DEPTH",),
        "train_batch_size": ("TRAIN.BATCH_SIZE",),
        "test_batch_size": ("TEST.BATCH_SIZE",),
        "accum_steps": ("TRAIN.ACCUM_STEPS",),
        "pipeline_stages": ("PIPELINE.STAGES",),
        "pipeline_stages_per_rank": ("PIPELINE.STAGES_PER_RANK",),
        "pipeline_micro_batches": ("PIPELINE.MICRO_BATCHES",),
        "pipeline_schedule": ("PIPELINE.SCHEDULE",),
        "mesh_dp": ("MESH.DP",),
        "mesh_dp_replicate": ("MESH.DP_REPLICATE",),
        "mesh_tp": ("MESH.TP",),
        "mesh_pp": ("MESH.PP",),
    },
    "OPTIMIZER_SETTINGS": {
        "name": ("OPTIM.OPTIMIZER",),
        "lr": ("OPTIM.BASE_LR",),
        "weight_decay": ("OPTIM.WEIGHT_DECAY",),
        "weight_decay_scale": ("OPTIM.WEIGHT_DECAY_SCALE",),
        "no_decay_weight_decay": ("OPTIM.WEIGHT_DECAY_NO_DECAY_GROUP",),
        "layer_decay": ("OPTIM.LAYER_DECAY",),
        "depth": ("VIT.DEPTH",),
        "momentum": ("OPTIM.MOMENTUM",),
        "dampening": ("OPTIM.DAMPENING",),
        "nesterov": ("OPTIM.NESTEROV",),
        "betas": ("OPTIM.BETAS",),
        "eps": ("OPTIM.EPS",),
        "contiguous": ("OPTIM.CONTIGUOUS_PARAMS",),
        "one_pass": ("OPTIM.ONE_PASS",),
        "muon_lr_mult": ("MUON.LR_MULT",),
        "muon_weight_decay": ("MUON.WEIGHT_DECAY",),
        "muon_momentum": ("MUON.MOMENTUM",),
        "muon_nesterov": ("MUON.NESTEROV",),
        "muon_ns_steps": ("MUON.NS_STEPS",),
        "muon_adjust_lr": ("MUON.ADJUST_LR",),
    },
    "LR_SCHEDULE_ARGS": {
        "base_lr": ("OPTIM.BASE_LR",),
        "min_lr": ("OPTIM.MIN_LR",),
        "max_epoch": ("OPTIM.MAX_EPOCH",),
        "policy": ("OPTIM.LR_POLICY",),
        "steps": ("OPTIM.STEPS",),
        "lr_mult": ("OPTIM.LR_MULT",),
        "warmup_epochs": ("OPTIM.WARMUP_EPOCHS",),
        "warmup_factor": ("OPTIM.WARMUP_FACTOR",),
        "onecycle_pct_start": ("OPTIM.ONECYCLE_PCT_START",),
        "onecycle_div_factor": ("OPTIM.ONECYCLE_DIV_FACTOR",),
        "cycle_epochs": ("OPTIM.CYCLE_EPOCHS",),
        "warmup_steps": ("OPTIM.WARMUP_STEPS",),
        "warmup_prefix": ("OPTIM.WARMUP_PREFIX",),
    },
}
TABLES = {
    "ENGINE_SETTINGS": (engine, EngineSettings),
    "DDP_SETTINGS": (engine, DDPSettings),
    "FSDP_SETTINGS": (engine, FSDPSettings),
    "PIPELINE_SETTINGS": (engine, PipelineSettings),
    "MESH_SETTINGS": (engine, MeshSettings),
    "LAUNCH_SETTINGS": (engine, LaunchSettings),
    "OPTIMIZER_SETTINGS": (optimization, OptimizerSettings),
    "LR_SCHEDULE_ARGS": (optimization, LRScheduleSettings),
}


@pytest.mark.parametrize("name", sorted(HAND_ROWS))
def test_each_generated_row_reads_the_keys_its_hand_written_row_read(name):
    """Caught: a field renamed without ``Key(...)`` keeping its key (OptimizerSettings.lr read
    from OPTIM.LR), a field that lost its ``ReadFrom`` (MeshSettings.batch_size), a row gone."""
    c = get_default_cfg()
    section, _ = TABLES[name]
    rows = {arg: tuple(sorted(keys_read(row, c))) for arg, row in getattr(section, name).items()}
    assert rows == HAND_ROWS[name]


def test_the_defaults_build_records_equal_to_the_records_own_defaults():
    """The keys' defaults are the fields' (but where a key says why not: DEVICE auto), so the
    default config builds each record as its class defaults it, the parts read from other
    sections' keys aside. Caught: a key given a default of its own (``Key(default=...)``,
    DDP.BUCKET_CAP_MB 30) that the field lacks."""
    c = get_default_cfg()
    args = lambda table: {a: row(c) for a, row in table.items()}  # noqa: E731
    read_elsewhere = {"batch_size", "accum_steps", "depth", "train_batch_size", "test_batch_size",
                      "float8_micro_batch", "device", "pipeline_stages", "pipeline_micro_batches",
                      "mesh_dp", "mesh_tp", "mesh_pp", "mesh_dp_replicate",
                      "pipeline_stages_per_rank", "pipeline_schedule", "engine",
                      "cpu_collectives", "base_lr"}  # fmt: skip
    for name, (section, record) in TABLES.items():
        built = record(**args(getattr(section, name)))
        for field in args(getattr(section, name)):
            if field not in read_elsewhere:
                assert getattr(built, field) == getattr(record(), field), (name, field)
    assert AmpSettings(**args(amp.AMP_SETTINGS)) == AmpSettings()


CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_bundled_config_builds_its_records(path):
    """Each record of every bundled config is built and holds the key's value (caught: a reader
    that returns the key's default)."""
    try:
        c = read_cfg(path, [])
    except ConfigError:  # a config of an image folder names none: any folder reads the keys
        c = read_cfg(path, ["DATA.PATH", "/data"])
    for name, (section, record) in TABLES.items():
        record(**{a: row(c) for a, row in getattr(section, name).items()})
    engine_args = {a: row(c) for a, row in engine.ENGINE_SETTINGS.items()}
    assert engine_args["compile"] == c.TRAIN.COMPILE
    optim_args = {a: row(c) for a, row in optimization.OPTIMIZER_SETTINGS.items()}
    assert optim_args["lr"] == c.OPTIM.BASE_LR and optim_args["betas"] == tuple(c.OPTIM.BETAS)
    schedule = {a: row(c) for a, row in optimization.LR_SCHEDULE_ARGS.items()}
    assert schedule["policy"] == c.OPTIM.LR_POLICY
