"""How a run is spread over devices and processes: the engine (TRAIN.PARALLEL and its settings
DDP, FSDP, PIPELINE, MESH), compilation (TRAIN.COMPILE), the device and the processes (DEVICE,
NUM_PROCS, CPU_THREADS); docs/distributed.md, docs/tensor_parallel.md. What the keys become: the
engine's settings (``ENGINE_SETTINGS`` and its parts, ``pycls.engines.settings``) and the
launcher's (``LAUNCH_SETTINGS``, ``pycls.distributed.launch_settings.LaunchSettings``), whose
fields the keys are generated from (``pycls.config.records``). Which feature
works with which engine is the rule of ``pycls.engines.support``, over every section's FEATURES.
"""

import math

from pycls.config.records import RecordKeys, joined
from pycls.config.sections.key_checks import get, require
from pycls.distributed.launch_settings import LaunchSettings, engine_of
from pycls.distributed.mesh_layout import mesh_shape, replica_shape
from pycls.engines.settings import (
    FSDP_BACKENDS,
    DDPSettings,
    EngineSettings,
    FSDPSettings,
    MeshSettings,
    PipelineSettings,
)
from pycls.models.vit.args import ffn_hidden_width, tp_divisors

# ------------------------------------------------------------------------------------------------ #
# The keys, generated from the fields of the records they become (pycls.engines.settings,
# pycls.distributed.launch_settings): each with its default, its meaning and its values. AMP's and
# BN's keys of EngineSettings are the amp and model_cnn sections'
# ------------------------------------------------------------------------------------------------ #
ENGINE_RECORD = RecordKeys(EngineSettings, "TRAIN", home="engine")
DDP_RECORD = RecordKeys(DDPSettings, "DDP", home="engine")
FSDP_RECORD = RecordKeys(FSDPSettings, "FSDP", home="engine")
PIPELINE_RECORD = RecordKeys(PipelineSettings, "PIPELINE", home="engine")
MESH_RECORD = RecordKeys(MeshSettings, "MESH", home="engine")
LAUNCH_RECORD = RecordKeys(LaunchSettings, "", home="engine")
RECORDS = (ENGINE_RECORD, DDP_RECORD, FSDP_RECORD, PIPELINE_RECORD, MESH_RECORD, LAUNCH_RECORD)
_KEYS = joined(*(record.section("engine") for record in RECORDS))
_C = _KEYS.tree
# The generated keys' reference texts (a hand-written key has its comment above it)
REFERENCE = _KEYS.reference

# Engine: "torch" (FSDP2, fully_shard per transformer block and on the root; CPU or CUDA) or
# "fairscale" (FairScale FullyShardedDataParallel per block; CUDA only). It feeds the engine's
# name with TRAIN.PARALLEL (pycls.distributed.launch_settings.engine_of)
_C.FSDP.BACKEND = "torch"


# ------------------------------------------------------------------------------------------------ #
# Checks: the value tables (from the fields' choices and bounds) and the combinations
# ------------------------------------------------------------------------------------------------ #
CHOICES = {**_KEYS.choices, "FSDP.BACKEND": FSDP_BACKENDS}
POSITIVE = _KEYS.positive
NON_NEGATIVE = _KEYS.non_negative


def engine_name(c):
    """The engine the config selects (a key of pycls.engines.support.ENGINES)."""
    return engine_of(c.TRAIN.PARALLEL, c.FSDP.BACKEND)


def check(c):
    """How TRAIN.COMPILE compiles needs TRAIN.COMPILE; MESH.*: only under TRAIN.PARALLEL tensor
    (MESH.DP_REPLICATE under fsdp too: ``_check_replicas``); TP must divide the heads and the MLP
    width, and the mesh the processes when their number is known now (NUM_PROCS; a launcher's
    processes are checked at launch: pycls.distributed.preflight)."""
    check_compile_options(c)
    _check_replicas(c)
    m = c.MESH
    if c.TRAIN.PARALLEL != "tensor":
        for key, default in (("MESH.TP", 1), ("MESH.PP", 1), ("MESH.DP", 0)):
            require(
                get(c, key) == default,
                key,
                f"{get(c, key)} describes the device mesh of TRAIN.PARALLEL tensor, not of "
                f"TRAIN.PARALLEL {c.TRAIN.PARALLEL}",
            )
        return
    if c.MODEL.TYPE != "vit":
        return  # the engine x feature rule names the CNN families
    _check_vit_mesh(c)
    stages = c.PIPELINE.STAGES
    require(
        stages in (_C.PIPELINE.STAGES, m.PP),
        "PIPELINE.STAGES",
        f"{stages}: under TRAIN.PARALLEL tensor the pipeline's stages are MESH.PP ({m.PP}); set "
        f"MESH.PP {stages} instead",
    )
    require(
        not c.FSDP.CPU_OFFLOAD,
        "FSDP.CPU_OFFLOAD",
        "is untested with TRAIN.PARALLEL tensor (host-resident shards of tensor-parallel parts); "
        "set it False",
    )
    require(
        m.PP == 1 or c.FSDP.RESHARD_AFTER_FORWARD == _C.FSDP.RESHARD_AFTER_FORWARD,
        "FSDP.RESHARD_AFTER_FORWARD",
        "applies to FSDP2, which MESH.PP > 1 does not run (the replicas of a stage average its "
        "gradients); leave it at its default",
    )
    if c.NUM_PROCS > 1:
        mesh_shape(c.NUM_PROCS, m.DP, m.TP, m.PP)


def _selected(c):
    """The engine the config selects, in the keys' words."""
    if engine_name(c) == "fairscale":
        return "TRAIN.PARALLEL fsdp with FSDP.BACKEND fairscale"
    return f"TRAIN.PARALLEL {c.TRAIN.PARALLEL}"


def _check_replicas(c):
    """MESH.DP_REPLICATE: FSDP2's replicas, under the engines that run FSDP2 (fsdp with the torch
    backend, tensor without pipeline stages), dividing the data-parallel processes where their
    number is known (MESH.DP, or NUM_PROCS; a launcher's processes are checked at launch)."""
    m, replicate = c.MESH, c.MESH.DP_REPLICATE
    if replicate == _C.MESH.DP_REPLICATE:
        return
    engine = engine_name(c)
    require(
        engine in ("fsdp", "tensor"),
        "MESH.DP_REPLICATE",
        f"{replicate}: replicas of FSDP2's shards, which TRAIN.PARALLEL fsdp (FSDP.BACKEND torch) "
        f"and tensor have and {_selected(c)} has not; leave it at 0",
    )
    require(
        engine != "tensor" or m.PP == 1 or replicate == 1,
        "MESH.DP_REPLICATE",
        f"{replicate}: with MESH.PP {m.PP} the replicas of a stage average its gradients without "
        "FSDP2, so there is nothing to shard within a replica; set it 0 or 1",
    )
    dp = 0
    if engine == "tensor":
        known = c.NUM_PROCS > 1 and c.NUM_PROCS % (m.TP * m.PP) == 0
        dp = m.DP or (c.NUM_PROCS // (m.TP * m.PP) if known else 0)
    elif c.NUM_PROCS > 1:
        dp = c.NUM_PROCS
    if dp:
        replica_shape(dp, replicate)


def check_compile_options(c):
    """What torch.compile is asked to do needs TRAIN.COMPILE (nothing else compiles the model)."""
    for key in ("TRAIN.COMPILE_MODE", "TRAIN.COMPILE_COORDINATE_DESCENT"):
        require(
            c.TRAIN.COMPILE or get(c, key) == get(_C, key),
            key,
            f"{get(c, key)} says how TRAIN.COMPILE compiles, but TRAIN.COMPILE is False: set it "
            "True, or leave this key at its default",
        )


def _check_vit_mesh(c):
    """The ViT's heads and feed-forward width split over MESH.TP, its blocks over the chunks."""
    m, v = c.MESH, c.VIT
    hidden = ffn_hidden_width(v.MLP_DIM, v.FFN_WIDTH, v.FFN_ALIGN)
    width = f"VIT.MLP_DIM={v.MLP_DIM}"
    if hidden != v.MLP_DIM:
        width += f" (the feed-forward's {hidden} with VIT.FFN_WIDTH {v.FFN_WIDTH}, VIT.FFN_ALIGN "
        width += f"{v.FFN_ALIGN})"
    for what, n in ((f"VIT.NUM_HEADS={v.NUM_HEADS}", v.NUM_HEADS), (width, hidden)):
        require(
            n % m.TP == 0,
            "MESH.TP",
            f"{m.TP} does not divide {what} (each process holds an equal share of the heads "
            "and of the hidden channels); values that divide the heads and the hidden width: "
            f"{tp_divisors(math.gcd(v.NUM_HEADS, hidden))}",
        )
    chunks = m.PP * c.PIPELINE.STAGES_PER_RANK
    require(
        m.PP == 1 or chunks <= v.DEPTH,
        "MESH.PP",
        f"{m.PP} stages x PIPELINE.STAGES_PER_RANK {c.PIPELINE.STAGES_PER_RANK} = {chunks} "
        f"chunks, more than the {v.DEPTH} blocks of VIT.DEPTH (every chunk needs a block)",
    )


# ------------------------------------------------------------------------------------------------ #
# The features the keys switch on (the engine x feature rule: pycls.engines.support), from the
# fields that declare one
# ------------------------------------------------------------------------------------------------ #
FEATURES = _KEYS.features


# ------------------------------------------------------------------------------------------------ #
# What the keys become: pycls.engines.settings.EngineSettings (its parts DDPSettings,
# FSDPSettings, PipelineSettings, MeshSettings) and pycls.distributed.launch_settings's
# LaunchSettings, one row per argument, generated from the fields
# ------------------------------------------------------------------------------------------------ #
ENGINE_SETTINGS = ENGINE_RECORD.arguments
DDP_SETTINGS = DDP_RECORD.arguments
FSDP_SETTINGS = FSDP_RECORD.arguments
PIPELINE_SETTINGS = PIPELINE_RECORD.arguments
MESH_SETTINGS = MESH_RECORD.arguments
LAUNCH_SETTINGS = LAUNCH_RECORD.arguments
