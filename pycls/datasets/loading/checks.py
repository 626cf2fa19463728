"""What the data sets promise the trainer: the test split has the training split's classes, and
the corrupt samples a run skipped are named.

- ``check_classes``: a test split whose class folders differ from the training split's.
- ``check_class_samples``: a class with no training images (a warning), refused when the test
  split has images of it (the model would be scored on a class it never saw).
- ``SkippedFiles``: the corrupt samples a run skipped (``DATA_LOADER.SKIP_CORRUPT``), named in
  the log (the first few) and in ``OUT_DIR/skipped_files.txt`` (all of them).
"""

import logging
import os

import torch

from pycls.errors import UserError, describe_write_error, one_line


class ClassMismatchError(UserError, ValueError):
    """The test split's classes differ from the training split's (labels would shift)."""


# ------------------------------------------------------------------------------------------------ #
# Class lists
# ------------------------------------------------------------------------------------------------ #


def check_classes(train_classes, test_classes, where):
    """Raises ClassMismatchError listing the classes missing from or extra in the test split.

    ``where`` names the two sources (e.g. "train split /data/train vs test split /data/val").
    None on either side (a data set without class names, such as CIFAR) is not checked.
    """
    if train_classes is None or test_classes is None:
        return
    train, test = list(train_classes), list(test_classes)
    if train == test:
        return
    missing = [c for c in train if c not in set(test)]
    extra = [c for c in test if c not in set(train)]
    detail = []
    if missing:
        detail.append(f"missing from the test split: {_few(missing)}")
    if extra:
        detail.append(f"not in the training split: {_few(extra)}")
    if not detail:
        detail.append("the same names in another order")
    raise ClassMismatchError(
        f"class folders differ ({where}): {'; '.join(detail)}. Labels are indices into the "
        "training split's class list, so every test class must be one of the training classes "
        "and every training class must be present"
    )


def _first_attribute(dataset, name):
    """``name`` of a data set, or of the first one it wraps (``.base``) that has it; None."""
    seen = 0
    while dataset is not None and seen < 8:
        value = getattr(dataset, name, None)
        if value is not None:
            return value
        dataset, seen = getattr(dataset, "base", None), seen + 1
    return None


def labels_of(dataset):
    """The labels (int64 tensor) of a (possibly wrapped, ``.base``) data set, or None."""
    labels = _first_attribute(dataset, "labels")
    return None if labels is None else torch.as_tensor(labels, dtype=torch.int64)


def check_class_samples(train, test, where):
    """Warns (and returns the names of) classes of ``train`` without a training image; raises
    ClassMismatchError when ``test`` (a data set, or None) has images of one of them. ``where``
    names the two splits. A data set without class names or labels is not checked."""
    classes, labels = classes_of(train), labels_of(train)
    num_classes = _first_attribute(train, "num_classes")
    if classes is None or labels is None or num_classes != len(classes):
        return []  # no names, or a subset relabelled (DATA.CLASSES): its own rule applies
    counts = torch.bincount(labels, minlength=len(classes))
    empty = [k for k in range(len(classes)) if counts[k] == 0]
    if not empty:
        return []
    test_labels = labels_of(test) if test is not None else None
    if test_labels is not None:
        tested = torch.bincount(test_labels, minlength=len(classes))
        scored = [k for k in empty if k < len(tested) and tested[k] > 0]
        if scored:
            shown = _few([f"{classes[k]} ({int(tested[k])})" for k in scored])
            raise ClassMismatchError(
                f"classes without a training image have test images ({where}): {shown}. The "
                "model would be scored on classes it never saw: add their training images, or "
                "remove them from both splits (DATA.CLASSES keeps a subset)"
            )
    names = [classes[k] for k in empty]
    logging.getLogger(__name__).warning(
        f"{len(names)} class(es) have no training image ({where}): {_few(names)}; the model "
        "has an output for each that no label ever asks for (an empty class folder?)"
    )
    return names


def _few(names, n=10):
    shown = ", ".join(map(str, names[:n]))
    return f"{shown} (+{len(names) - n} more)" if len(names) > n else shown


# ------------------------------------------------------------------------------------------------ #
# Skipped corrupt files
# ------------------------------------------------------------------------------------------------ #

SKIPPED_FILES = "skipped_files.txt"


class NoSamplesError(UserError):
    """Every sample of a split (or of an epoch) was skipped as corrupt: there is nothing to train
    or evaluate on; the message names where the skipped files are listed."""


def refuse_all_skipped(stats, samples, consequence, out_dir):
    """Raises NoSamplesError when every one of the ``samples`` a meter's epoch ``stats`` counted
    was skipped as corrupt (``consequence``: what that leaves undone)."""
    if stats["num_samples"] == 0 and stats["num_skipped"] > 0:
        raise NoSamplesError(
            f"every one of the {stats['num_skipped']} {samples} was skipped as corrupt "
            f"(DATA_LOADER.SKIP_CORRUPT): {consequence}; they are named in "
            f"{os.path.join(out_dir, SKIPPED_FILES)}"
        )


class SkippedFiles:
    """Names the corrupt samples skipped under DATA_LOADER.SKIP_CORRUPT: the first ``show`` in
    the log, every one (once) in ``OUT_DIR/skipped_files.txt``, also across resumes: the lines
    an earlier attempt of the run wrote count as seen."""

    def __init__(self, out_dir=None, show=5):
        self.path = os.path.join(out_dir, SKIPPED_FILES) if out_dir else None
        self.show, self.seen, self.logged = show, set(), 0
        self._logger = logging.getLogger(__name__)
        if self.path and os.path.isfile(self.path):
            with open(self.path, encoding="utf-8", errors="replace") as f:
                self.seen.update(line.rstrip("\n") for line in f)

    def add(self, reasons, log=True):
        """``log`` False: the reasons were logged already (a damaged shard, by its reader)."""
        # One line each, whatever bytes a file name holds (a newline, bytes that are not UTF-8)
        new = [one_line(r) for r in reasons]
        new = [r for r in dict.fromkeys(new) if r not in self.seen]
        for reason in new:
            self.seen.add(reason)
            if not log:
                continue
            self.logged += 1
            if self.logged <= self.show:
                self._logger.warning(f"skipped a corrupt sample: {reason}")
            if self.logged == self.show + 1 and self.path:
                self._logger.warning(f"more corrupt samples skipped; all are listed in {self.path}")
        if new and self.path:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write("".join(r + "\n" for r in new))
            except OSError as e:
                self._logger.error(describe_write_error(self.path, e))


_SKIPPED = SkippedFiles()


def set_skipped_files(out_dir, show=5):
    """Where this process records skipped samples from now on."""
    global _SKIPPED
    _SKIPPED = SkippedFiles(out_dir, show)
    return _SKIPPED


def record_skipped(num_skipped):
    """Records the reasons a collated batch carries
    (``pycls.datasets.loading.corrupt_samples.SkipCount``)."""
    reasons = getattr(num_skipped, "reasons", ())
    if reasons:
        _SKIPPED.add(reasons)


def record_damaged(problems):
    """Records damaged shards read in part under DATA_LOADER.SKIP_CORRUPT (one line each, naming
    the shard and the samples missing) with the corrupt samples skipped."""
    if problems:
        _SKIPPED.add(problems, log=False)  # the reader logged them


def classes_of(dataset):
    """The class names of a (possibly wrapped, ``.base``) data set, or None when it has none."""
    seen = 0
    while dataset is not None and seen < 8:
        classes = getattr(dataset, "classes", None)
        if classes is not None:
            return list(classes)
        dataset, seen = getattr(dataset, "base", None), seen + 1
    return None
