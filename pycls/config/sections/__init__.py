"""The config's sections: one module per group of keys, the one owner of each of its keys. A
section declares:

- ``_C``: its keys, each with its default and, in a comment above it, what it means (the key
  reference: ``pycls.config.defaults`` assembles the sections into the tree); or keys generated
  from the fields of a settings record (``pycls.config.records``: the VIT keys from ``VitArgs``,
  the engine's, the launcher's, AMP's, the optimizer's and the schedule's from theirs, the
  DATA_LOADER keys of the loader, the URL reads and the readers from ``LoaderSettings``,
  ``UrlReadSettings`` and ``ReaderSettings``: ``RECORDS`` below), their meanings in
  ``REFERENCE`` and their tables below generated with them;
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
uses it and its docs page; an option of a record, its field only (docs/changing_pycls.md).
"""

from pycls.config.records import update_page
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

# The settings records whose fields generate keys
RECORDS = (
    model_vit.VIT_RECORD,
    *engine.RECORDS,
    amp.AMP_RECORD,
    *optimization.RECORDS,
    data.LOADER_RECORD,
    data.URL_READ_RECORD,
    data.READER_RECORD,
)
# Those with a part of their own in the key reference of docs/configs.md (the whole tree's table,
# pycls.config.key_reference, names every record's fields)
PAGE_RECORDS = (model_vit.VIT_RECORD, data.LOADER_RECORD, data.URL_READ_RECORD, data.READER_RECORD)


def key_reference(page):
    """``page`` (the text of docs/configs.md) with each record's part of the key reference
    generated again from its fields."""
    for record in PAGE_RECORDS:
        page = update_page(page, record.name, record.markdown())
    return page
