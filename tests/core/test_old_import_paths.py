"""Every import users rely on works unchanged after the house moved: each documented old path (a
re-export shim, README: "Old import paths") gives the very objects of the module that now holds
them, and each package face still offers every name it offered."""

import importlib

import pytest

# Old path -> {the module that now holds them: names users import from the old path}
OLD_PATHS = {
    "pycls.core.config": {"pycls.config": ["load_cfg", "assert_cfg", "dump_cfg", "DEFAULTS"]},
    "pycls.core.optimizer": {
        "pycls.optim": ["AdamW", "SGD", "LAMB", "param_groups", "no_weight_decay_names"],
        "pycls.core.builders": [("construct_optimizer", "build_optimizer")],
    },
    "pycls.core.precision": {
        "pycls.engines.precision": ["Precision", "DynamicLossScaler", "NoLossScaler"],
        "pycls.engines.cpu_amp": ["cpu_bf16_flags"],
    },
    "pycls.core.weights": {
        "pycls.checkpoint.weight_files": ["load_weights", "save_safetensors", "WeightsError"],
        "pycls.core.exports": ["export_checkpoint", "model_from_checkpoint"],
    },
    "pycls.models.blocks": {
        "pycls.models.vit.blocks": [
            "Attention",
            "DropPath",
            "EncoderBlock",
            "LocalFeedForward",
            "SDPA_BACKENDS",
            "place_rates",
        ],
        "pycls.models.vit.position": ["grid_side", "sincos_pos_embed"],
        "pycls.models.groups": ["NORM_TYPES", "named_saved_buffers"],
    },
    "pycls.models.token_masks": {
        "pycls.models.vit.token_masks": ["TokenBatch", "drop_patches", "computed_tokens"],
        "pycls.models.vit.args": ["DROP_PATH_MODES", "PACKED_ATTENTIONS"],
    },
    "pycls.models.complexity": {
        "pycls.models.vit.complexity": ["vit_complexity", "vit_run_flops", "UNCOUNTED"],
    },
    "pycls.models.vit_zoo": {
        "pycls.models.vit.variants": ["build_vit", "list_vit_models", "vit_b16", "vit_22b14"],
        "pycls.models.vit.args": ["VIT_SPECS"],
    },
    "pycls.engines.tensor_plan": {
        "pycls.models.vit.tensor_plan": ["QKVLayout", "parallelize_vit", "GroupDropPath"],
        "pycls.models.vit.args": ["check_vit_split", "tp_divisors"],
    },
    "pycls.engines.stages": {
        "pycls.models.vit.pipeline_cut": ["partition", "block_ranges", "ViTChunk", "BALANCES"],
        "pycls.engines.pipeline": [
            ("PipelinedViT", "PipelinedModel"),
            "apply_pipeline",
            "SCHEDULES",
        ],
    },
    "pycls.optim.factory": {
        "pycls.optim.optimizer_settings": [
            "OptimizerSettings",
            "optimizer_from_settings",
            "OPTIMIZERS",
        ],
    },
    "pycls.datasets.loader": {
        "pycls.datasets.loading.loader": [
            "SeededSampler",
            "AugmentedDataset",
            "DeviceBatches",
            "construct_loader",
            "collate_skipping",
            "sample_seed",
        ],
    },
    "pycls.datasets.transforms": {
        "pycls.datasets.loading.transforms": ["PRESETS", "build_transform", "BatchMixer"],
    },
}


def _pairs():
    for old, homes in OLD_PATHS.items():
        for home, names in homes.items():
            for name in names:
                old_name, new_name = name if isinstance(name, tuple) else (name, name)
                yield old, old_name, home, new_name


@pytest.mark.parametrize("old,old_name,home,new_name", list(_pairs()))
def test_an_old_import_path_gives_the_object_of_its_new_home(old, old_name, home, new_name):
    shim = importlib.import_module(old)
    assert getattr(shim, old_name) is getattr(importlib.import_module(home), new_name)
    assert old_name in getattr(shim, "__all__", [old_name])


# Package -> the names its face offered before the house moved (its eager __init__'s imports)
FACES = {
    "pycls.models": [
        "AnyNet", "EffNet", "PretrainedWeightsUnavailable", "RegNet", "ResNet", "VIT_SPECS",
        "VisionTransformer", "ZOO", "anynet_complexity", "build_model", "build_vit", "effnet",
        "effnet_complexity", "from_torchvision", "list_models", "regnet_complexity", "regnetx",
        "regnety", "resample_pos_embed", "resnet", "resnet_complexity", "resnext", "vit_22b14",
        "vit_b16", "vit_b32", "vit_bigg14", "vit_complexity", "vit_g14", "vit_h14", "vit_h16",
        "vit_l16", "vit_s16", "vit_ti16",
    ],
    "pycls.models.vit": [
        "CLASSIFIERS", "FFNS", "LAYOUTS", "POS_EMBEDS", "RESIDUAL_DTYPES", "STEMS",
        "VisionTransformer", "from_timm", "from_torchvision", "resample_pos_embed",
    ],
    "pycls.engines": [
        "DDPEngine", "DDPSettings", "EngineSettings", "FSDPEngine", "FSDPSettings",
        "FairScaleEngine", "MeshSettings", "PipelineEngine", "PipelineSettings", "Precision",
        "SingleProcess", "TensorParallelEngine", "TensorParallelPipelineEngine", "engine_class",
        "model_init_device", "parallelize",
    ],
    "pycls.distributed": [
        "ConfigError", "INTERRUPTED_EXIT_CODE", "PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS",
        "Preempted", "PreemptionFlag", "ProcessEnv", "all_reduce_max", "all_reduce_sum",
        "available_cpus", "barrier", "broadcast_object", "cpu_threads", "destroy_process_group",
        "exit_process", "first_slurm_host", "get_rank", "get_world_size", "groups_joined",
        "init_process_group", "init_single_process_group", "is_initialized", "is_main_proc",
        "launcher_env", "local_world_size", "parse_first_host", "resolve_device",
        "restarts_share_agent_store", "set_cpu_threads", "slurm_env", "stop_pending",
        "torchrun_env", "wants_cuda",
    ],
    "pycls.config": [
        "ConfigError", "DEFAULTS", "apply_arch", "assert_cfg", "bundled_config_names",
        "bundled_configs_dir", "cfg_from_yaml_text", "describe_non_default", "dump_cfg", "get",
        "get_default_cfg", "load_cfg", "non_default_items", "require", "resnet_layout",
        "resolve_cfg_file", "use_data_folder",
    ],
    "pycls.datasets": [
        "AugmentedDataset", "Cifar", "CorruptImageError", "DATASETS", "DATASET_STATS",
        "DEFAULT_AUGMENT", "DEFAULT_MAX_PIXELS", "DeviceBatches", "Digits", "ImageFolder",
        "PRESETS", "SeededSampler", "Synthetic", "build_dataset", "build_transform",
        "collate_skipping", "construct_loader", "sample_seed",
    ],
    "pycls.optim": [
        "LAMB", "SGD", "AdamW", "Muon", "OnePassAdamW", "OptimizerSettings",
        "no_weight_decay_names", "optimizer_from_settings", "param_groups",
    ],
}  # fmt: skip


@pytest.mark.parametrize("package", sorted(FACES))
def test_a_package_face_offers_every_name_it_offered(package):
    face = importlib.import_module(package)
    missing = [name for name in FACES[package] if not hasattr(face, name)]
    assert not missing, f"{package} no longer offers {missing}"
    star = {}
    exec(f"from {package} import *", star)  # noqa: S102  (what `import *` gives users)
    assert set(FACES[package]) <= set(star)


def test_a_face_keeps_a_name_that_a_submodule_shares():
    """pycls.models.resnet and .effnet are the zoo's functions, as they were, even once the
    modules of the same names are imported."""
    import pycls.models.effnet
    import pycls.models.resnet  # noqa: F401
    from pycls import models
    from pycls.models import zoo

    assert models.resnet is zoo.resnet and models.effnet is zoo.effnet
