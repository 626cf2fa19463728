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

from pycls.package_faces import install_face

install_face(
    __name__,
    {
        "defaults": [
            "DEFAULTS",
            "get_default_cfg",
        ],
        "loading": [
            "apply_arch",
            "bundled_config_names",
            "bundled_configs_dir",
            "cfg_from_yaml_text",
            "describe_non_default",
            "dump_cfg",
            "load_cfg",
            "non_default_items",
            "resolve_cfg_file",
            "use_data_folder",
        ],
        "validation": [
            "assert_cfg",
            "get",
            "resnet_layout",
        ],
        "pycls.errors": [
            "ConfigError",
            "require",
        ],
    },
)
