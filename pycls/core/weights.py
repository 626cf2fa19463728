"""Re-export shim, kept because users import from it: ``pycls.core.weights`` gathers what a user
needs to take a run's weights elsewhere. The models rebuilt from checkpoints and their exports
live in ``pycls.core.exports``; the file formats in ``pycls.checkpoint.weight_files``."""

from pycls.checkpoint.weight_files import (  # noqa: F401  (re-exported)
    EXPORT_FORMATS,
    FORMATS,
    WeightsError,
    export_model,
    final_weights_path,
    load_weights,
    read_metadata,
    read_state_dict,
    read_weights,
    save_safetensors,
    timm_model_from_export,
)
from pycls.core.exports import export_checkpoint, model_from_checkpoint  # noqa: F401
