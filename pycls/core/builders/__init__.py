"""Builders: the only place where the config becomes objects. Models, losses, datasets, loaders,
engines and optimizers take plain arguments or small settings; the builders hand them what the
config's sections say the keys become (``pycls.config.sections``: the argument and settings
tables) and construct them, nothing else:

- ``model_builders``: the models (from their sections' argument tables), models from checkpoints,
  the teacher;
- ``data_builders``: datasets, loaders, device batches, the token-budget sampler;
- ``training_builders``: the loss, optimizer, AMP level, engine and launch settings, schedules,
  mixer, EMA and the one training step.

Every name is here (``from pycls.core.builders import build_model``), imported eagerly: no
torch-free read enters this package.
"""

from pycls.core.builders.data_builders import (
    augment_on_device,
    augment_preset,
    build_dataset,
    build_loader,
    build_token_loader,
    build_token_sampler,
    dataset_name,
    device_batches,
    normalisation,
    num_prefix_tokens,
    per_process_batch,
    read_window,
    sharded_files,
    token_budget_images,
    token_sizes,
)
from pycls.core.builders.model_builders import (
    FAMILIES,
    build_model,
    build_teacher,
    build_teacher_module,
    channels_last,
    check_claimed_model,
    memory_format,
    model_from_checkpoint,
    model_keys,
    model_kwargs,
    teacher_identity,
    teacher_module_and_file,
    vit_kwargs,
    weights_file,
)
from pycls.core.builders.training_builders import (
    arguments,
    build_ema,
    build_image_size_schedule,
    build_loss_fn,
    build_lr_schedule,
    build_mixer,
    build_optimizer,
    build_patch_drop_schedule,
    build_precision,
    build_token_counter,
    build_training_step,
    engine_settings,
    launch_settings,
    optimizer_settings,
)
