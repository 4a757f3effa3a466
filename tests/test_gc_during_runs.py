"""Objects older than the runs under way are frozen while they run (wsi_pipeline.gc_during_runs)."""

import gc
import weakref

import pytest

from wsi_pipeline import gc_during_runs
from wsi_pipeline.gc_during_runs import during_run, run_began, run_ended, runs_under_way


@pytest.fixture(autouse=True)
def _no_run_under_way():
    assert runs_under_way() == 0 and gc.get_freeze_count() == 0
    yield
    assert runs_under_way() == 0 and gc.get_freeze_count() == 0


class _Node:
    pass


def test_frozen_from_the_first_run_begun_to_the_last_ended():
    run_began()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    made_between = [[i] for i in range(1000)]
    run_began()  # a second run under way freezes nothing more
    assert gc.get_freeze_count() == frozen
    run_ended()
    assert gc.get_freeze_count() == frozen and runs_under_way() == 1
    run_ended()
    assert gc.get_freeze_count() == 0
    del made_between


def test_a_cycle_older_than_the_run_is_collected_once_the_run_ends():
    node = _Node()
    node.me = node
    ref = weakref.ref(node)
    with during_run():
        del node
        gc.collect()
        assert ref() is not None  # frozen: the run's collections skip it
    gc.collect()
    assert ref() is None


def test_a_cycle_made_during_the_run_is_collected_during_it():
    with during_run():
        node = _Node()
        node.me = node
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None


def test_a_process_that_froze_its_objects_keeps_them_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with during_run():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_a_disabled_collector_is_left_alone():
    gc.disable()
    try:
        with during_run():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_run_ended_without_run_began_raises():
    with pytest.raises(RuntimeError):
        run_ended()
    assert gc_during_runs.runs_under_way() == 0
