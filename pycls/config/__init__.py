"""The configuration: one yacs tree that is the single source of truth for a run.

- ``sections``: one module per group of keys, the one owner of each: its keys with their defaults
  and meanings, its checks, the features it turns on and what its keys become (the arguments and
  settings the builders hand on);
- ``defaults``: the tree, assembled from the sections;
- ``validation``: ``assert_cfg`` runs every section's checks and the engine x feature rule;
- ``loading``: defaults <- YAML file <- ``KEY VALUE`` overrides, checked and frozen
  (``read_cfg``: pure, no torch, no file but the YAML), dumped as YAML (``dump_cfg``), read back
  from checkpoints;
- ``machine``: what the config means on the machine that runs it (``resolve_for_machine``: the
  device, a CPU's AMP level, what DATA.PATH holds), once per run, recorded in config.yaml;
  ``load_cfg`` reads and resolves;
- ``upstream_keys``: upstream pycls's keys, translated while a file loads (the table is
  ``upstream_keys.yaml``).

Only this package, the builders (``pycls.core.builders``) and the commands read the config: models,
engines, checkpoints and launchers take plain arguments. Adding a key: docs/changing_pycls.md.
"""

from typing import TYPE_CHECKING

from pycls.package_faces import install_face

# The face (pycls.package_faces): each name imports its module on first use, so that read_cfg and
# assert_cfg cost no torch (load_cfg resolves the config for the machine, with torch)
if TYPE_CHECKING:
    from pycls.config.defaults import DEFAULTS, get_default_cfg
    from pycls.config.loading import (
        apply_arch,
        bundled_config_names,
        bundled_configs_dir,
        cfg_from_yaml_text,
        describe_non_default,
        dump_cfg,
        non_default_items,
        read_cfg,
        resolve_cfg_file,
    )
    from pycls.config.machine import load_cfg, resolve_for_machine, use_data_folder
    from pycls.config.sections.key_checks import get
    from pycls.config.sections.model_cnn import resnet_layout
    from pycls.config.validation import assert_cfg
    from pycls.errors import ConfigError, require

install_face(__name__)
