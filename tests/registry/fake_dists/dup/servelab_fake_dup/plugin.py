"""A plugin that registers a scheduler under a name servelab-fake-sjf already uses."""

from servelab_fake_sjf.plugin import ShortestJobFirst

from servelab import hookimpl


class AnotherShortestJobFirst(ShortestJobFirst):
    """Same name, other owner."""


@hookimpl
def servelab_register_schedulers():
    return {"fake_sjf": AnotherShortestJobFirst}
