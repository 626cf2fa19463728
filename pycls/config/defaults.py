"""The key tree: every key pycls understands, assembled from the sections that own them
(``pycls.config.sections``). Each key is defined, with its default and what it means, in its
section's module (pycls/config/sections/*.py, the key reference); no key is defined twice.
``pycls.config.validation`` says which values and combinations are valid; ``pycls.config.loading``
merges files and overrides into a copy of these defaults.
"""

from yacs.config import CfgNode

from pycls.config.sections import SECTIONS


def _assemble(sections):
    """One tree of every section's keys, and the section that owns each key."""
    tree, owners = CfgNode(), {}
    for section in sections:
        _merge(tree, section._C, section.__name__.rsplit(".", 1)[-1], owners, "")
    return tree, owners


def _merge(tree, part, owner, owners, prefix):
    for name, value in part.items():
        key = prefix + name
        if isinstance(value, CfgNode):
            if name not in tree:
                tree[name] = CfgNode()
            _merge(tree[name], value, owner, owners, key + ".")
            continue
        if key in owners:
            raise AssertionError(f"{key} is declared by both {owners[key]} and {owner}")
        owners[key] = owner
        tree[name] = value


_C, OWNERS = _assemble(SECTIONS)  # OWNERS: dotted key -> the section that declares it
DEFAULTS = _C.clone()


def get_default_cfg():
    """A fresh, mutable copy of the defaults."""
    return DEFAULTS.clone()
