"""Objects alive when a pipeline is built stay out of full collections while any pipeline is open."""

from __future__ import annotations

import gc
import weakref

import pytest

from wsi_pipeline import Pipeline, long_lived


@pytest.fixture(autouse=True)
def _no_other_pipeline_open():
    if long_lived.holders():
        pytest.skip("a pipeline another test left open keeps objects frozen")


def test_objects_are_frozen_while_a_pipeline_is_open_and_handed_back_at_the_last_close():
    assert gc.get_freeze_count() == 0
    first = Pipeline.from_card(backend="ort", writer_processes=0)
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the modules and the model
    second = Pipeline.from_card(backend="ort", writer_processes=0)
    first.close()
    assert gc.get_freeze_count() >= frozen  # the second still holds them
    second.close()
    second.close()  # a second close releases nothing more
    assert gc.get_freeze_count() == 0 and long_lived.holders() == 0


def test_a_cycle_that_dies_while_a_pipeline_is_open_is_collected_after_its_close():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    with Pipeline.from_card(backend="ort", writer_processes=0):
        del a, b
        gc.collect()
        assert alive() is not None  # frozen with everything alive at the build
    gc.collect()
    assert alive() is None
