"""What the server does before and around its first request: a scheduler is handed back only once its worker has
made its decoder (which may time its engines: nothing of the caller's runs beside that), a decoder that cannot be
made fails the scheduler's construction, a retired version is freed, and the KV buffers come zero-filled and
writable on their own pages."""

from __future__ import annotations

import mmap
import threading

import numpy as np
import pytest

from serving.scheduler import Scheduler
from tasks.engines.contract import zeroed


class SlowToStart:
    """A runtime whose batch decoder is made only once `release` is set (as the ONNX decoder's bfloat16 probe
    takes a while), or fails; `asked` is set when the worker starts making it."""

    def __init__(self, error: Exception | None = None) -> None:
        self.asked, self.release, self.made = threading.Event(), threading.Event(), threading.Event()
        self.release.set()  # by default no wait: tests that watch the wait clear it
        self.error = error
        self.reserved: list[int] = []
        self.reserve_error: Exception | None = None

    def batch_decoder(self):
        self.asked.set()
        assert self.release.wait(30), "the test never let the decoder be made"
        if self.error is not None:
            raise self.error
        self.made.set()
        fields = {
            "kv_tokens": None,
            "chunked_prefill": False,
            "active": 0,
            "steps": 0,
            "reserve": lambda _, rows: self.reserve(rows),
        }
        return type("Decoder", (), fields)()

    def reserve(self, rows: int) -> None:
        if self.reserve_error is not None:
            raise self.reserve_error
        self.reserved.append(rows)


def test_a_scheduler_is_handed_back_once_its_worker_has_made_its_decoder_with_room_for_max_batch():
    runtime = SlowToStart()
    runtime.release.clear()
    made: list[Scheduler] = []
    constructing = threading.Thread(target=lambda: made.append(Scheduler(runtime, max_batch=3, max_queue=2)))
    constructing.start()
    assert runtime.asked.wait(30)
    assert constructing.is_alive() and not made  # the decoder is being made: the caller still waits
    runtime.release.set()
    constructing.join(30)
    scheduler = made[0]
    try:
        assert runtime.made.is_set() and runtime.reserved == [3]
        assert scheduler.alive
    finally:
        scheduler.close()


def test_a_decoder_that_cannot_be_made_fails_the_scheduler_its_caller_makes():
    """A version whose engine cannot start is not loaded (the server keeps serving what it has): the worker's
    error, raised where the scheduler is made."""
    with pytest.raises(RuntimeError, match="no engine"):
        Scheduler(SlowToStart(RuntimeError("no engine")), max_batch=2, max_queue=2)


def test_kv_rows_that_cannot_be_set_up_ahead_are_taken_as_they_join():
    runtime = SlowToStart()
    runtime.reserve_error = MemoryError("no room")
    scheduler = Scheduler(runtime, max_batch=2, max_queue=2)
    try:
        assert scheduler.alive
    finally:
        scheduler.close()


@pytest.mark.parametrize("shape", [(2, 3), (16, 3, 512, 64)])
def test_kv_buffers_come_zero_filled_and_writable(shape):
    buffer = zeroed(shape, np.float32)
    assert buffer.shape == shape and buffer.dtype == np.float32
    if buffer.nbytes >= 1 << 20:  # its own mapping, not numpy's allocation (which asks for huge pages)
        base = buffer
        while isinstance(base, np.ndarray | memoryview):
            base = base.base if isinstance(base, np.ndarray) else base.obj
        assert isinstance(base, mmap.mmap)
    assert not buffer.any()
    buffer[...] = 1.5
    assert float(buffer.sum()) == 1.5 * buffer.size


def test_a_retired_version_is_freed_though_what_the_server_loaded_at_start_is_frozen():
    """The server freezes what it loaded out of the collector's way; a version swapped out later must still be
    freed, reference cycles included (only the collector frees those)."""
    import gc
    import weakref

    from serving.models import LoadedModel

    runtime = SlowToStart()
    runtime.cycle = runtime  # a reference cycle, as engines' objects have
    loaded = LoadedModel("1", runtime, Scheduler(runtime, max_batch=2, max_queue=2))
    gone = weakref.ref(runtime)
    gc.collect()
    gc.freeze()
    try:
        del runtime
        loaded.retire()
        del loaded
        for thread in [t for t in threading.enumerate() if t.name == "llmopt-retire"]:
            thread.join(30)  # closed, then collected
        assert gone() is None
    finally:
        gc.unfreeze()
