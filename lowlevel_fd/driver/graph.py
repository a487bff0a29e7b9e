"""CUDA graphs by stream capture: ``with capture(stream) as graph: ...`` then ``graph.launch``."""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator

from ._api import cu, raw
from .stream import StreamLike, stream_handle


def _destroy_graph(graph: Any, executable: Any) -> None:
    try:
        if executable is not None:
            cu.cuGraphExecDestroy(executable)
        cu.cuGraphDestroy(graph)
    except Exception:
        pass


class Graph:
    """An instantiated CUDA graph. Replay with ``launch(stream)``; the kernels read the same
    buffer addresses they were captured with, so update inputs in place between replays."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.executable: Any = None
        self._finalizer: weakref.finalize | None = None

    def _adopt(self, graph: Any) -> None:
        self.handle = graph
        self.executable = cu.cuGraphInstantiate(graph, 0)
        self._finalizer = weakref.finalize(self, _destroy_graph, graph, self.executable)

    @property
    def node_count(self) -> int:
        self._require()
        return int(cu.cuGraphGetNodes(self.handle, 0)[1])

    def node_kinds(self) -> dict[str, int]:
        """How many nodes of each type (``kernel``, ``memcpy``, ``memset``, ...) it holds."""
        self._require()
        count = self.node_count
        nodes, _ = cu.cuGraphGetNodes(self.handle, count)
        prefix = "CU_GRAPH_NODE_TYPE_"
        kinds: dict[str, int] = {}
        for node in nodes[:count]:
            kind = raw.CUgraphNodeType(cu.cuGraphNodeGetType(node)).name[len(prefix):].lower()
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds

    def _require(self) -> None:
        if self.executable is None or self.closed:
            raise RuntimeError("graph: not instantiated (capture did not finish) or closed")

    def upload(self, stream: StreamLike) -> None:
        """Upload the graph's resources ahead of the first launch (optional)."""
        self._require()
        cu.cuGraphUpload(self.executable, stream_handle(stream))

    def launch(self, stream: StreamLike) -> None:
        self._require()
        cu.cuGraphLaunch(self.executable, stream_handle(stream))

    @property
    def closed(self) -> bool:
        return self._finalizer is not None and not self._finalizer.alive

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "Graph":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def capture(stream: StreamLike, *, thread_local: bool = True) -> Iterator[Graph]:
    """Record the work issued on ``stream`` into a graph instead of running it.

    The stream must not be the legacy default stream. On leaving the block the capture ends
    and the returned ``Graph`` is instantiated; if the block raises, the capture is discarded.
    """
    handle = stream_handle(stream)
    if int(handle) == 0:
        raise ValueError("stream: capture needs a created stream, got the legacy default stream")
    mode = (raw.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL if thread_local
            else raw.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL)
    graph = Graph()
    cu.cuStreamBeginCapture(handle, mode)
    try:
        yield graph
    except BaseException:
        captured = raw.cuStreamEndCapture(handle)
        if captured[0] == raw.CUresult.CUDA_SUCCESS and captured[1] is not None:
            _destroy_graph(captured[1], None)
        raise
    graph._adopt(cu.cuStreamEndCapture(handle))


def is_capturing(stream: StreamLike) -> bool:
    status = cu.cuStreamIsCapturing(stream_handle(stream))
    return status != raw.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
