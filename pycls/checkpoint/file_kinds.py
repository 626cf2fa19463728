"""What a file given as weights or a checkpoint is, from its first bytes, and what to say when
torch cannot load it.

torch's own message for a file its weights-only loader refuses advises loading it again with
``weights_only=False``, which runs whatever code the file holds: the advice must never reach a
user about a file of unknown origin. ``load_failure`` says instead what the file is (not a
weights file at all, one holding Python objects pycls never loads, or a torch file cut short or
corrupt).
"""

import os
import re

# How the files pycls reads begin: torch.save's zip archive, torch's legacy format (a pickle whose
# first object is its magic number), a safetensors file (a little-endian header size, then JSON)
_ZIP = b"PK\x03\x04"
_LEGACY_TORCH = b"\x80\x02\x8a\x0a"
_HEAD_BYTES = 16


def head(path):
    """The first bytes of ``path``, or None when it cannot be opened here (a remote path)."""
    try:
        with open(path, "rb") as f:
            return f.read(_HEAD_BYTES)
    except OSError:
        return None


def kind(path):
    """ "torch" (torch.save's zip or legacy format), "safetensors", "empty", "other" (a text file,
    an image, ...) or None (it cannot be opened here)."""
    start = head(path)
    if start is None:
        return None
    if not start:
        return "empty"
    if start.startswith((_ZIP, _LEGACY_TORCH)):
        return "torch"
    size = int.from_bytes(start[:8], "little") if len(start) > 8 else 0
    if start[8:9] == b"{" and 0 < size < os.path.getsize(path):
        return "safetensors"
    return "other"


def not_weights(path):
    """Why ``path`` is not read as weights when ``kind`` is "empty" or "other", else None."""
    found = kind(path)
    if found == "empty":
        return "it is empty, not a weights file"
    if found != "other":
        return None
    return (
        f"not a weights file (neither a torch file nor safetensors; it begins {head(path)!r}); "
        "give a pycls checkpoint, a state dict saved with torch.save, or a .safetensors file"
    )


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_failure(path, exc):
    """Why torch.load (weights only) failed with ``exc`` on ``path``, in words: what the file is
    and why it is not read, never torch's advice to load it without ``weights_only``."""
    why = not_weights(path)
    if why is not None:
        return why
    text = str(exc)
    if "Weights only load failed" in text or "Unsupported global" in text:
        found = _GLOBAL.search(text)
        named = f" ({found.group(1)})" if found else ""
        return (
            f"it holds Python objects{named} besides tensors and plain values: pycls never loads "
            "those, as loading them would run code from the file; save the state dict alone "
            "(torch.save(model.state_dict(), path)) or use safetensors"
        )
    sentence = re.split(r"(?<=[.?!])\s", " ".join(text.split()), maxsplit=1)[0]
    if "weights_only" in sentence:
        sentence = ""
    cause = f"{type(exc).__name__}: {sentence}" if sentence else type(exc).__name__
    return f"truncated or corrupt? ({cause})"
