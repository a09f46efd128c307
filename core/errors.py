"""The errors servelab raises. Each message names the problem and the valid choices."""


class ServelabError(Exception):
    """Base class of every servelab error."""


class ConfigError(ServelabError, ValueError):
    """A configuration that cannot be built: unknown part, unknown option, bad combination."""


class RequestError(ServelabError, ValueError):
    """One request is invalid; the engine and every other request are unaffected."""


class PluginError(ServelabError):
    """A plugin broke a rule of the plugin system (duplicate name, missing methods)."""


class WorkerError(ServelabError, RuntimeError):
    """A tensor-parallel worker failed (died, raised or stopped answering); the
    message names its rank and the cause. The engine cannot continue."""
