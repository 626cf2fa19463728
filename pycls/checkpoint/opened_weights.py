"""A weights file or folder opened once: what it is decided where it is opened, and the one reader
of that kind chosen then, so that whoever builds a model from it (a distillation teacher, an
evaluated checkpoint, an export) asks the file nothing again.

The kinds (``OpenedWeights.kind``):

- ``"sharded checkpoint"``: a torch.distributed.checkpoint folder pycls wrote (verified against its
  manifest);
- ``"pycls checkpoint"``: a single ``.pyth`` checkpoint of this pycls (its checksum verified);
- ``"upstream checkpoint"``: upstream pycls's ``.pyth`` (no checksum; its better weights are read
  as data);
- ``"pycls safetensors"``: a ``.safetensors`` file pycls wrote (its metadata holds the config);
- ``"safetensors"`` and ``"state dict"``: another program's weights (a safetensors file, or a
  torch file of a plain state dict), in pycls, timm or torchvision naming, detected from the keys.

A run folder or its checkpoints/ folder stands for its newest checkpoint
(``resume.find_checkpoint``).
"""

import os
from dataclasses import dataclass

import torch

from pycls.checkpoint import file_digest, file_kinds, resume, sharded, single_file, weight_files
from pycls.checkpoint.files import CheckpointError
from pycls.models.cnn import upstream_weights

# The kinds that hold pycls's own config beside the weights (a model can be rebuilt from them)
WITH_CONFIG = ("sharded checkpoint", "pycls checkpoint", "pycls safetensors")


@dataclass(frozen=True)
class OpenedWeights:
    """A weights file or folder, opened: its ``path`` (a run folder's newest checkpoint), its
    ``kind`` (see the module's docstring), the config ``key`` that named it (for messages), the
    config stored inside (``cfg_text``, "" where none), and a checkpoint's train ``state``
    (read and verified; None for the other kinds)."""

    path: str
    kind: str
    key: str
    cfg_text: str = ""
    state: dict | None = None
    refused: str = ""  # a "state dict": why it is no pycls checkpoint (a checkpoint's reader says)
    allow_unverified: bool = False  # a sharded folder without a manifest was accepted
    # ((name, shape), ...) of the model tensors of a kind WITH_CONFIG, read from its headers (a
    # checkpoint's train state, a folder's metadata, a safetensors header) when it was opened
    shapes: tuple = ()

    def load_into(self, model, *, new_head=False, naming="auto"):
        """Its weights into ``model`` (a plain module), by the reader of its kind; returns the
        train state of a checkpoint (None for plain weights). ``new_head``: a head for another
        number of classes is dropped (fine-tuning); ``naming``: the plain weights' naming
        ("auto" detects it)."""
        if self.kind == "sharded checkpoint":
            return sharded.load_model_weights(self.path, model, self.allow_unverified)
        if self.kind == "pycls checkpoint":  # read and verified when it was opened
            return single_file.restore_checkpoint(self.path, self.state, model=model)
        weight_files.load_weights(self.path, model, naming, new_head=new_head, key=self.key)
        return None

    def load_exactly(self, model, what):
        """Its tensors, in the file's own naming, into ``model`` strictly (a timm or zoo
        teacher's file: a state dict, possibly under "model"); raises WeightsError naming the
        key when they do not fit ``what`` (the model's name)."""
        state = weight_files.read_state_dict(self.path, self.key)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0]
            raise weight_files.WeightsError(
                f"{self.key}: {self.path} does not fit {what}: {first}"
            ) from None
        return model

    def digest(self) -> str:
        """The SHA-256 of the file (or folder), cached by size and modification time."""
        return file_digest.digest(self.path)

    def identity(self, name: str) -> dict:
        """What a run records of the teacher ``name`` (DISTILL.TEACHER) these weights are: the
        name, the file (or folder) and its SHA-256."""
        return {"teacher": name, "file": self.path, "sha256": self.digest()}


def open_weights(path: str, key: str, allow_unverified: bool = False) -> OpenedWeights:
    """``path`` opened (see the module's docstring): its kind decided from what it is and its
    first bytes, a checkpoint read and verified once (a folder without a manifest only with
    ``allow_unverified``). A path that is not there, or a folder holding no checkpoint, raises
    naming ``key``."""
    if not os.path.exists(path):
        raise weight_files.WeightsError(f"{key}: {path} does not exist")
    path = resume.find_checkpoint(path, key)
    if not (os.path.isdir(path) or os.path.isfile(path)):  # a FIFO would block the first read
        raise weight_files.WeightsError(f"{key}: {path} is not a regular file")
    if sharded.is_sharded_checkpoint(path):
        state = sharded.read_state(path, allow_unverified)
        shapes = tuple(sharded.stored_model_shapes(path, state).items())
        return OpenedWeights(path, "sharded checkpoint", key, state.get("cfg") or "", state,
                             allow_unverified=allow_unverified, shapes=shapes)  # fmt: skip
    if path.endswith(".safetensors") or file_kinds.kind(path) == "safetensors":
        try:
            cfg_text = weight_files.read_metadata(path).get("cfg", "")
        except Exception as e:  # safetensors' own errors: a header that is not one
            raise weight_files.WeightsError(f"{key}: cannot read {path} as safetensors: {e}") from e
        if not cfg_text:
            return OpenedWeights(path, "safetensors", key)
        shapes = tuple(weight_files.stored_shapes(path).items())
        return OpenedWeights(path, "pycls safetensors", key, cfg_text, shapes=shapes)
    obj, failure = _torch_object(path)  # read once: its kind is decided from what it holds
    if upstream_weights.is_upstream_checkpoint(obj):
        return OpenedWeights(path, "upstream checkpoint", key)
    try:
        if failure is not None:
            why = file_kinds.load_failure(path, failure)
            raise CheckpointError(f"checkpoint {path} cannot be read: {why}")
        state = single_file.verified(obj, path)
    except CheckpointError as e:  # another program's weights, or a damaged checkpoint
        return OpenedWeights(path, "state dict", key, refused=str(e))
    shapes = tuple(sharded.stored_model_shapes(path, state).items())
    return OpenedWeights(
        path, "pycls checkpoint", key, state.get("cfg") or "", state, shapes=shapes
    )


def _torch_object(path):
    """(what a regular torch file holds, read as data (``weights_only``), None), or (None, why
    torch could not read it)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except Exception as e:  # noqa: BLE001 (any failure: said by the reader of its kind)
        return None, e
