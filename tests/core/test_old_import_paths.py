"""Every import users rely on works unchanged after the house moved: each documented old path (a
re-export shim, README: "Old import paths") gives the very objects of the module that now holds
them, each package face still offers every name it offered, and the release note says where
the names of each path that moved went."""

import importlib
import importlib.util
import os
import re

import pytest

from tests.helpers import ROOT

# Old path -> {the module that now holds them: names users import from the old path}
OLD_PATHS = {
    "pycls.core.config": {"pycls.config": ["load_cfg", "assert_cfg", "dump_cfg", "DEFAULTS"]},
    "pycls.core.optimizer": {
        "pycls.optim": ["AdamW", "SGD", "LAMB", "param_groups", "no_weight_decay_names"],
        "pycls.core.builders": [("construct_optimizer", "build_optimizer")],
    },
    "pycls.models.anynet": {"pycls.models.cnn.anynet": ["AnyNet", "anynet_complexity"]},
    "pycls.models.regnet": {
        "pycls.models.cnn.regnet": ["RegNet", "regnet_complexity", "regnet_to_anynet"]
    },
    "pycls.models.resnet": {"pycls.models.cnn.resnet": ["ResNet", "resnet_complexity"]},
    "pycls.models.effnet": {"pycls.models.cnn.effnet": ["EffNet", "effnet_complexity"]},
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


def _moved_rows():
    """(old paths, new homes) of each row of docs/changing_pycls.md's "Moved in this release"."""
    with open(os.path.join(ROOT, "docs", "changing_pycls.md"), encoding="utf-8") as f:
        note = f.read().split("## Moved in this release", 1)[1]
    rows = [line.strip("|").split("|")[:2] for line in note.splitlines() if "| `pycls." in line]
    assert len(rows) >= 10, "the release note's table of moved paths is missing"
    return rows


@pytest.mark.parametrize("old,new", _moved_rows())
def test_the_release_note_says_where_each_moved_name_is(old, new):
    """A path the note moves is gone, or a shim this file keeps working; each module the note
    names after it offers each name it lists in parentheses (a name misspelt in the note, or
    moved again without the note, fails here)."""
    for path in re.findall(r"`(pycls\.[\w.]+)`", old):
        kept = path in OLD_PATHS or importlib.util.find_spec(path) is None
        assert kept, f"{path}: the note moves it, yet it imports and is no shim kept here"
    module = None
    for token in re.findall(r"`([\w.]+)`", new):
        if token.startswith("pycls."):
            module = importlib.import_module(token)
        else:
            assert hasattr(module, token), f"{module.__name__} has no {token} (the note says so)"


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
    "pycls.core.builders": [
        "build_model", "model_kwargs", "build_teacher", "weights_file", "model_from_checkpoint",
        "build_dataset", "build_loader", "device_batches", "build_token_loader", "build_loss_fn",
        "build_optimizer", "build_precision", "engine_settings", "launch_settings",
        "build_lr_schedule", "build_ema", "build_training_step",
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
