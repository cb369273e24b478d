"""The collector is kept off a process's startup heap while its engines live
(`minisgl_backend.startup_heap`)."""

from __future__ import annotations

import gc
from pathlib import Path

from minisgl_backend import LLM, SamplingParams
from minisgl_backend import startup_heap
from minisgl_backend.benchmark.collector import collector_pauses


class _Marker:
    """An object the collector tracks."""


def test_freezes_nest_and_the_last_thaw_lets_the_collector_see_everything_again() -> None:
    others = startup_heap._holders  # engines of this test process that still hold a freeze
    startup_heap.freeze_startup_heap()
    startup_heap.freeze_startup_heap()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    startup_heap.thaw_startup_heap()
    assert gc.get_freeze_count() >= frozen  # one freeze is still held
    startup_heap.thaw_startup_heap()
    assert startup_heap._holders == others
    if others == 0:
        assert gc.get_freeze_count() == 0
        startup_heap.thaw_startup_heap()  # one thaw too many changes nothing
        assert startup_heap._holders == 0


def test_an_llm_freezes_the_heap_from_its_start_to_its_shutdown(
        tiny_models: dict[str, Path]) -> None:
    """Objects made before the engine started are frozen while it serves; a second engine's
    shutdown leaves the first one's freeze in place; the last shutdown thaws."""
    others = startup_heap._holders
    made_before = _Marker()
    assert gc.is_tracked(made_before)
    with LLM(tiny_models["llama"], device="cpu") as first:
        assert gc.get_freeze_count() > 0
        assert not any(o is made_before for o in gc.get_objects())  # frozen: not in a generation
        with LLM(tiny_models["llama"], device="cpu") as second:
            assert startup_heap._holders == others + 2
        assert startup_heap._holders == others + 1
        assert gc.get_freeze_count() > 0
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        assert len(first.generate([[1, 2, 3]], params)[0].token_ids) == 4
        del second
    assert startup_heap._holders == others
    if others == 0:
        assert gc.get_freeze_count() == 0
        assert any(o is made_before for o in gc.get_objects())


def test_collector_pauses_count_the_collections_inside_the_block() -> None:
    with collector_pauses() as pauses:
        gc.collect()  # a full collection
        gc.collect(0)
    assert pauses.counts[2] >= 1 and pauses.counts[0] >= 1
    assert pauses.seconds >= pauses.longest_full_s > 0
    assert "full collections" in pauses.describe()
    counted = list(pauses.counts)
    gc.collect()  # outside the block: not counted
    assert pauses.counts == counted
