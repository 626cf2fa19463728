"""YAML config files read strictly: a key written twice in one mapping is an error; an unknown
key is named with the known keys closest to it.

Plain YAML keeps the last value silently, so an edited file would train on a value nobody sees.
A leaf module (it imports only pycls.errors): the config and sweep-file loaders call it before yacs
parses.
"""

import difflib

import yaml  # PyYAML: what yacs itself parses with

from pycls.errors import ConfigError


class _DuplicateKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise ConfigError(
                    f"{self.option}: {self.name}: key {key!r} appears twice in one section (lines "
                    f"{lines[key]} and {line}); keep one"
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def check_duplicate_keys(text, name, option="--cfg"):
    """Raises ConfigError naming the key and both lines when ``text`` (the YAML file ``name``,
    given with the command-line ``option``) writes a key twice in one mapping, at any depth."""
    loader = _DuplicateKeyLoader(text)
    loader.name, loader.option = name, option
    try:
        loader.get_single_data()
    finally:
        loader.dispose()


def dotted_keys(tree, prefix=""):
    """Every key of a nested mapping (a yacs CfgNode) as a dotted name, groups included."""
    keys = []
    for key, value in tree.items():
        keys.append(prefix + str(key))
        if isinstance(value, dict):
            keys += dotted_keys(value, f"{prefix}{key}.")
    return keys


def did_you_mean(key, known):
    """ " (did you mean A?)" naming the keys of ``known`` closest to the unknown ``key`` (case
    ignored; difflib's ratio of 0.75 or more, and within 0.1 of the closest), or "" when none is
    close."""
    by_upper = {k.upper(): k for k in known}
    wanted = str(key).upper()
    close = difflib.get_close_matches(wanted, list(by_upper), n=3, cutoff=0.75)
    if not close:
        return ""
    ratios = [difflib.SequenceMatcher(None, wanted, c).ratio() for c in close]
    close = [c for c, r in zip(close, ratios) if r >= ratios[0] - 0.1]
    return f" (did you mean {' or '.join(by_upper[c] for c in close)}?)"
