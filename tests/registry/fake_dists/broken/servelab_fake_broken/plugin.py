"""A plugin whose import fails, as when an optional dependency is missing."""

import servelab_fake_missing_dependency  # noqa: F401

from servelab import hookimpl


@hookimpl
def servelab_register_schedulers():
    return {}
