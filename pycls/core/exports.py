"""The weights of a trained pycls run, for use elsewhere: the model rebuilt from a checkpoint's
own config (``model_from_checkpoint``, which the builders own: a distillation teacher is built
the same way), and exported in pycls (safetensors), timm or torchvision naming
(``export_checkpoint``). The file formats themselves live in ``pycls.checkpoint.weight_files``.
"""

from pycls.checkpoint import resume
from pycls.checkpoint.weight_files import EXPORT_FORMATS, WeightsError, export_model
from pycls.core.builders import (
    augment_preset,
    check_claimed_model,
    model_from_checkpoint,
    normalisation,
)
from pycls.datasets.loading.transforms import eval_data_config

__all__ = ["check_claimed_model", "export_checkpoint", "model_from_checkpoint"]


def export_checkpoint(path: str, fmt: str, out: str | None = None) -> str:
    """Writes the weights of pycls checkpoint ``path`` for use elsewhere (``export_model``'s
    formats); returns the file, by default named after ``path``."""
    if fmt not in EXPORT_FORMATS:
        raise WeightsError(f"--format: {fmt!r} is not one of {list(EXPORT_FORMATS)}")
    path = resume.find_checkpoint(path, "checkpoint")  # the output is named after the file
    model, cfg = model_from_checkpoint(path)
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    stem = stem[: -len(".pyth")] if stem.endswith(".pyth") else stem.rstrip("/")
    if out is None:
        suffix = {"torchvision": "_torchvision.pth", "timm": "_timm.safetensors",
                  "timm_folder": "_timm"}.get(fmt)  # fmt: skip
        copy = "_copy" if path.endswith(".safetensors") else ""
        out = stem + (suffix or f"{copy}.safetensors")
    return export_model(model, cfg.dump(), fmt, out, source=path, data_config=data_config(cfg))


def data_config(cfg) -> dict:
    """How the run's config evaluates, in timm's pretrained-config terms: the evaluation data
    set's mean and std (or DATA.MEAN / DATA.STD), its preset's resize and crop at TEST.IM_SIZE."""
    mean, std = normalisation(cfg, train=False)
    preset = augment_preset(cfg, cfg.TEST.DATASET)
    return {"mean": tuple(mean), "std": tuple(std), **eval_data_config(preset, cfg.TEST.IM_SIZE)}
