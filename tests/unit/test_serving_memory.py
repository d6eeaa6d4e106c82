"""What the server does before and around its first request: a scheduler is handed back only once its worker has
made its decoder (which may time its engines: nothing of the caller's runs beside that), a decoder that cannot be
made leaves a closed scheduler, and the KV buffers come zero-filled and writable on regular pages."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from serving.requests import GenerationRequest, SchedulerClosed
from serving.sampling import Sampling
from serving.scheduler import Scheduler
from tasks.engines.contract import zeroed


class SlowToStart:
    """A runtime whose batch decoder takes a while to make (as the ONNX decoder's bfloat16 probe does), or fails."""

    def __init__(self, error: Exception | None = None) -> None:
        self.made = threading.Event()
        self.error = error
        self.reserved: list[int] = []

    def batch_decoder(self):
        time.sleep(0.3)
        if self.error is not None:
            raise self.error
        self.made.set()
        fields = {
            "kv_tokens": None,
            "chunked_prefill": False,
            "active": 0,
            "steps": 0,
            "reserve": lambda _, rows: self.reserved.append(rows),
        }
        return type("Decoder", (), fields)()


def test_a_scheduler_is_handed_back_once_its_worker_has_made_its_decoder_with_room_for_max_batch():
    runtime = SlowToStart()
    scheduler = Scheduler(runtime, max_batch=3, max_queue=2)
    try:
        assert runtime.made.is_set() and runtime.reserved == [3]
        assert scheduler.alive
    finally:
        scheduler.close()


def test_a_decoder_that_cannot_be_made_leaves_a_closed_scheduler_not_a_hung_caller():
    scheduler = Scheduler(SlowToStart(RuntimeError("no engine")), max_batch=2, max_queue=2)
    request = GenerationRequest([1, 2], 1, Sampling(), on_event=lambda event: None)
    with pytest.raises(SchedulerClosed):
        scheduler.submit(request)


@pytest.mark.parametrize("shape", [(2, 3), (16, 3, 512, 64)])
def test_kv_buffers_come_zero_filled_and_writable(shape):
    buffer = zeroed(shape, np.float32)
    assert buffer.shape == shape and buffer.dtype == np.float32
    assert not buffer.any()
    buffer[...] = 1.5
    assert float(buffer.sum()) == 1.5 * buffer.size
