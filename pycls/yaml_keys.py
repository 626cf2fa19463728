"""YAML config files read strictly: a key written twice in one mapping is an error.

Plain YAML keeps the last value silently, so an edited file would train on a value nobody sees.
A leaf module (it imports only pycls.errors): the config loader calls it before yacs parses.
"""

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
                    f"--cfg: {self.name}: key {key!r} appears twice in one section (lines "
                    f"{lines[key]} and {line}); keep one"
                )
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def check_duplicate_keys(text, name):
    """Raises ConfigError naming the key and both lines when ``text`` (the YAML file ``name``)
    writes a key twice in one mapping."""
    loader = _DuplicateKeyLoader(text)
    loader.name = name
    try:
        loader.get_single_data()
    finally:
        loader.dispose()
