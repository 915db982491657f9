"""The jobs: how a job is named and parsed (TorchTitan 0.3's config seam), above
``titan/``.

- ``config_registry``: Zephon's registry, named ``--module torchtitan_zephon.configs
  --config FN`` on the command line (TorchTitan imports
  ``torchtitan_zephon.configs.config_registry``), and the jobs a TOML file picks
  (``TOML_JOBS``);
- ``stock_config``: a stock TorchTitan registry job made Zephon's;
- ``models``: the model flavors the registry names;
- ``toml_table`` / ``toml_front``: the TOML front end (TorchTitan 0.2.2's
  spellings) and its one table;
- ``command_line``: the config managers that read both command lines
  (``--module``/``--config`` and the TOML one), called by ``torchtitan_zephon.train``.

This package re-exports nothing: import the modules.
"""
