"""servelab's Hydra configs. Importing this package (Hydra does, to read it)
stores the typed schema that conf/config.yaml names first in its defaults."""

from hydra.core.config_store import ConfigStore

from servelab.lab.config_schema import register_schemas

register_schemas(ConfigStore.instance())
