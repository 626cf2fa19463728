"""Builders: the only place where the config becomes objects. Models, losses, datasets, loaders,
engines and optimizers take plain arguments or small settings; the builders hand them what the
config's sections say the keys become (``pycls.config.sections``: the argument and settings
tables) and construct them, nothing else:

- ``model_builders``: the models (from their sections' argument tables), models from checkpoints,
  the teacher;
- ``data_builders``: datasets, loaders, device batches, the token-budget sampler;
- ``training_builders``: the loss, optimizer, AMP level, engine and launch settings, schedules,
  mixer, EMA and the one training step.

Every name is here (``from pycls.core.builders import build_model``).
"""

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "model_builders": [
            "FAMILIES",
            "model_kwargs",
            "vit_kwargs",
            "build_model",
            "model_keys",
            "weights_file",
            "channels_last",
            "memory_format",
            "model_from_checkpoint",
            "check_claimed_model",
            "build_teacher_module",
            "teacher_module_and_file",
            "teacher_identity",
            "build_teacher",
        ],
        "data_builders": [
            "dataset_name",
            "normalisation",
            "augment_preset",
            "augment_on_device",
            "sharded_files",
            "read_window",
            "build_dataset",
            "per_process_batch",
            "build_loader",
            "device_batches",
            "num_prefix_tokens",
            "token_sizes",
            "token_budget_images",
            "build_token_sampler",
            "build_token_loader",
        ],
        "training_builders": [
            "build_loss_fn",
            "arguments",
            "optimizer_settings",
            "build_optimizer",
            "build_precision",
            "engine_settings",
            "launch_settings",
            "build_lr_schedule",
            "build_image_size_schedule",
            "build_patch_drop_schedule",
            "build_mixer",
            "build_ema",
            "build_training_step",
            "build_token_counter",
        ],
    },
)
