"""fewer_gc_passes raises the collector's first threshold while a simulation serves and
restores the interpreter's after, even when the run raises; automatic collection that is
off stays off."""

import gc

import pytest

from servelab.lab.gc_passes import FIRST_THRESHOLD, fewer_gc_passes


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_raised_while_serving_and_restored_after(thresholds):
    gc.set_threshold(700, 10, 10)
    with pytest.raises(RuntimeError), fewer_gc_passes():
        assert gc.get_threshold() == (FIRST_THRESHOLD, 10, 10)
        raise RuntimeError("a failing run")
    assert gc.get_threshold() == (700, 10, 10)


def test_collection_that_is_off_stays_off(thresholds):
    gc.set_threshold(0, 10, 10)
    with fewer_gc_passes():
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold() == (0, 10, 10)
