"""A plugin with a misspelled hook name: it must fail loudly, not be ignored."""

from servelab import hookimpl


@hookimpl
def servelab_register_schedulerz():
    return {}
