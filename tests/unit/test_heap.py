"""core/heap.py: bulk imports with the cyclic collector paused, then frozen."""

from __future__ import annotations

import gc

import pytest

from core.heap import imports_without_gc

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if was else gc.disable()


def test_paused_inside_then_enabled_and_what_exists_frozen() -> None:
    gc.enable()
    gc.unfreeze()
    with imports_without_gc():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # tracked containers, as an import makes
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(made)
    collectable = {id(o) for o in gc.get_objects()}  # the frozen ones are in no generation a collection walks
    assert not any(id(x) in collectable for x in made)


def test_a_collector_turned_off_by_the_caller_stays_off() -> None:
    gc.disable()
    with imports_without_gc():
        pass
    assert not gc.isenabled()


def test_an_error_inside_still_restores() -> None:
    gc.enable()
    with pytest.raises(ImportError), imports_without_gc():
        raise ImportError("no such module")
    assert gc.isenabled()
