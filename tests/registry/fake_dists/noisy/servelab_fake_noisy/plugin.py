"""An observer that raises at every step."""

from servelab import hookimpl


class ObserverBroke(RuntimeError):
    pass


@hookimpl
def servelab_step_end(engine, step):
    raise ObserverBroke(f"observer broke at step {step['step']}")
