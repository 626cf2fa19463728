"""Labels where they enter pycls: every reader turns what its files store into class indices
here, and nothing else reaches the loss.

A label is a whole number from 0 to the class count - 1. What the files may hold instead, and
what becomes of it:

- a float: taken when it is integral (3.0 is class 3); 2.9999 or 0.5 is refused, never cut to
  an index;
- a string: a class name, when the data declares its classes (``_info.json``'s ``classes``, a
  parquet file's ClassLabel names); refused otherwise;
- a null, a boolean, anything else: refused.

The class count is the one the data declares where it declares one, else the model's
(``num_classes``, given by the builder) where one is given, else what an int64 holds. Each refusal
is a ``CorruptFileError`` naming the file and the sample (exit status 2).
"""

import math
from collections.abc import Callable, Sequence

import numpy as np

from pycls.checkpoint.files import CorruptFileError

# The largest label an int64 tensor holds: the bound when nothing declares the class count
MAX_LABEL = 2**63 - 1


def from_text(text: str) -> int | str:
    """A label stored as text (a tar's ``.cls`` member): a whole number, an integral float, or a
    class name (any other text). Raises ValueError for a number that is not whole."""
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return text
    return from_json(value)


def from_json(value) -> int | str:
    """A label stored as a JSON value: an integer, an integral float or a class name (a
    string). Raises ValueError for anything else, saying what it is."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{json_name(value)} is not a class index")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{value!r} is not a whole number (labels are not rounded)")
        return int(value)
    if isinstance(value, str):
        return value
    raise ValueError(f"a {type(value).__name__} is not a class index")


def json_name(value) -> str:
    return {None: "null", True: "true", False: "false"}.get(value, repr(value))


def class_indices(
    values: Sequence[int | str],
    classes: Sequence | None,
    limit: tuple[int, str] | None,
    name_of: Callable[[int], str],
) -> np.ndarray:
    """``values`` (integers or class names) as int64 class indices. ``classes``: the declared
    class names (for the strings); ``limit``: (class count, where it comes from), the bound of
    every index; ``name_of(i)``: the sample ``i`` as an error names it."""
    if set(map(type, values)) <= {int}:  # integers, as nearly always: one array
        try:
            out = np.array(values, dtype=np.int64)
        except OverflowError:  # one beyond int64: named below
            pass
        else:
            check_range(out, limit, name_of)
            return out
    lookup = {str(name): k for k, name in enumerate(classes)} if classes is not None else None
    out = np.empty(len(values), dtype=np.int64)
    for i, value in enumerate(values):
        if isinstance(value, str):
            if lookup is None:
                raise CorruptFileError(
                    f"{name_of(i)} has the label {value!r}, a class name, but the data declares "
                    "no class names to look it up in; store class indices"
                )
            if value not in lookup:
                raise CorruptFileError(
                    f"{name_of(i)} has the label {value!r}, which is not one of the "
                    f"{len(lookup)} declared class names"
                )
            value = lookup[value]
        if type(value) is not int:
            raise CorruptFileError(f"{name_of(i)} has the label {value!r}, not a class index")
        if not 0 <= value <= MAX_LABEL:
            raise _out_of_range(name_of(i), value, limit)
        out[i] = value
    check_range(out, limit, name_of)
    return out


def check_range(labels: np.ndarray, limit: tuple[int, str] | None, name_of) -> None:
    """Every label from 0 to the class count ``limit`` - 1 (vectorised: cheap for millions)."""
    if not len(labels):
        return
    bad = labels < 0
    if limit is not None:
        bad |= labels >= limit[0]
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise _out_of_range(name_of(i), int(labels[i]), limit)


def _out_of_range(name: str, value: int, limit) -> CorruptFileError:
    shown = str(value) if len(str(value)) <= 24 else f"{value:.3e}"
    if limit is None:
        bound = f"class indices are 0 to {MAX_LABEL}"
    else:
        bound = f"class indices are 0 to {limit[0] - 1}: {limit[0]} classes ({limit[1]})"
    return CorruptFileError(f"{name} has the label {shown}; {bound}")


def arrow_class_indices(array, names: Sequence | None, limit, name_of) -> np.ndarray:
    """A parquet label column (a pyarrow array) as int64 class indices: integers, integral
    floats, or class names where ``names`` declares them; a null or another type is refused
    naming the row."""
    import pyarrow as pa  # optional (pip install pycls-vit[data]): parquet data only
    import pyarrow.compute as pc  # optional, as above

    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if array.null_count:
        i = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        raise CorruptFileError(f"{name_of(i)} has no label (null)")
    kind = array.type
    if pa.types.is_integer(kind):
        values = array.to_numpy(zero_copy_only=False)
        if pa.types.is_uint64(kind) and len(values) and values.max() > MAX_LABEL:
            i = int(np.argmax(values))
            raise _out_of_range(name_of(i), int(values[i]), limit)
        labels = values.astype(np.int64)
    elif pa.types.is_floating(kind):
        values = array.to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) > 2.0**62)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CorruptFileError(
                f"{name_of(i)} has the label {float(values[i])!r}, not a whole number (a float "
                "label column is taken only when every value is integral; labels are not rounded)"
            )
        labels = values.astype(np.int64)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        if names is None:
            raise CorruptFileError(
                f"{name_of(0)} has the label {array[0].as_py()!r}: the label column holds "
                "strings, but the file declares no class names (a ClassLabel feature) to look "
                "them up in; store class indices"
            )
        found = pc.index_in(array, value_set=pa.array([str(n) for n in names]))
        if found.null_count:
            i = int(np.flatnonzero(found.is_null().to_numpy(zero_copy_only=False))[0])
            raise CorruptFileError(
                f"{name_of(i)} has the label {array[i].as_py()!r}, which is not one of the "
                f"{len(names)} class names the file declares"
            )
        labels = found.to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        raise CorruptFileError(
            f"{name_of(0)}: the label column holds {kind} values, not class indices"
        )
    check_range(labels, limit, name_of)
    return labels
