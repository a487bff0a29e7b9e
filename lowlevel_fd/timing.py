"""Event timing of device work: back-to-back replays, one event pair each (no host stalls)."""
from __future__ import annotations

from typing import Callable

from .driver import Event, Stream, capture


def time_replays(launch: Callable[[], None], stream: Stream, *, warmup: int,
                 iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``launch`` (which enqueues on ``stream``),
    after ``warmup`` untimed calls. All pairs are recorded before one synchronize, so the
    host never stalls the GPU between iterations."""
    for _ in range(warmup):
        launch()
    events = [(Event(stream.device), Event(stream.device)) for _ in range(iters)]
    for start, end in events:
        start.record(stream)
        launch()
        end.record(stream)
    stream.synchronize()
    return [end - start for start, end in events]


def time_graph(step: Callable[[], None], stream: Stream, *, warmup: int,
               iters: int) -> list[float]:
    """Capture ``step`` once on ``stream`` and time its replays (ms per replay)."""
    with capture(stream) as graph:
        step()
    try:
        graph.upload(stream)
        return time_replays(lambda: graph.launch(stream), stream, warmup=warmup, iters=iters)
    finally:
        stream.synchronize()
        graph.close()
