"""The configuration: one yacs tree that is the single source of truth for a run.

- ``defaults``: every key, its default and what it means;
- ``validation``: which values and combinations are valid (``assert_cfg``);
- ``loading``: defaults <- YAML file <- ``KEY VALUE`` overrides, validated and frozen
  (``load_cfg``), dumped as YAML (``dump_cfg``), read back from checkpoints;
- ``upstream_keys``: upstream pycls's keys, translated while a file loads (the table is
  ``upstream_keys.yaml``).

Only this package, the builders (``pycls.core.builders``) and the commands read the config: models,
engines, checkpoints and launchers take plain arguments.
"""

from pycls.config.defaults import DEFAULTS, get_default_cfg
from pycls.config.loading import (
    apply_arch,
    bundled_config_names,
    bundled_configs_dir,
    cfg_from_yaml_text,
    describe_non_default,
    dump_cfg,
    load_cfg,
    non_default_items,
    resolve_cfg_file,
    use_data_folder,
)
from pycls.config.validation import assert_cfg, get, resnet_layout
from pycls.errors import ConfigError, require

__all__ = [
    "DEFAULTS",
    "ConfigError",
    "apply_arch",
    "assert_cfg",
    "bundled_config_names",
    "bundled_configs_dir",
    "cfg_from_yaml_text",
    "describe_non_default",
    "dump_cfg",
    "get",
    "get_default_cfg",
    "load_cfg",
    "non_default_items",
    "require",
    "resnet_layout",
    "resolve_cfg_file",
    "use_data_folder",
]
