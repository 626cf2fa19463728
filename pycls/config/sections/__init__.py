"""The config's sections: one module per group of keys, the one owner of each of its keys. A
section declares:

- ``_C``: its keys, each with its default and, in a comment above it, what it means (the key
  reference: ``pycls.config.defaults`` assembles the sections into the tree);
- its checks: the value tables ``CHOICES``, ``POSITIVE``, ``NON_NEGATIVE``, ``BELOW_ONE``,
  ``FRACTIONS`` and a ``check(c)`` of the combinations (a check that reads another section's key
  names it in its message), and, for a model family, ``check_arguments(c)``: the model's own
  rules on the arguments the keys give (``pycls.config.validation`` runs them all);
- ``FEATURES``: {feature: (its key, when the config turns it on)}, the rows of the engine x
  feature rule (``pycls.engines.support``: which engine cannot run which feature, and why);
- what its keys become: tables of plain arguments or settings, one row per argument
  ({argument: how the config gives it}), which the builders (``pycls.core.builders``) hand to the
  constructors: ``model_vit.VIT_ARGS``, ``model_cnn``'s family tables,
  ``optimization.OPTIMIZER_SETTINGS``, ``engine.ENGINE_SETTINGS``, ``engine.LAUNCH_SETTINGS``...

Plain Python: no torch, no file but the YAML. Adding a key touches its section, the code that
uses it and its docs page (docs/changing_pycls.md).
"""

from pycls.config.sections import (
    amp,
    data,
    distill,
    engine,
    model,
    model_cnn,
    model_vit,
    optimization,
    run,
    tokens,
    train,
)

# In the order the tree lists their keys and assert_cfg runs their checks
SECTIONS = (
    model,
    model_vit,
    tokens,
    model_cnn,
    optimization,
    distill,
    data,
    train,
    engine,
    amp,
    run,
)
