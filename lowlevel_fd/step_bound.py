"""BoundStep: a DecodeStep's validated launches handed out one layer at a time
(``DecodeStep.bind``), for a model that runs its own work between the layers."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .driver import DeviceArray
from .driver.stream import StreamLike

if TYPE_CHECKING:
    from .step import DecodeStep


class BoundStep:
    """A DecodeStep's validated launches (``DecodeStep.bind``), issued one layer at a time:
    ``begin(stream)`` (the unfused step's positions copy), ``layer(i, stream)`` in order of i,
    ``end(stream)`` (the fused step's ``advance_lengths``). Together they issue what ``eager``
    issues, in its order. Each call checks only that the step was not re-planned or closed."""

    __slots__ = ("_step", "_calls", "_lengths", "_capacity", "_planned")

    def __init__(self, step: DecodeStep, calls: list, lengths: DeviceArray,
                 capacity: dict) -> None:
        self._step, self._calls, self._lengths, self._capacity = step, calls, lengths, capacity
        self._planned = step.attention._generation  # every plan() bumps it

    @property
    def num_layers(self) -> int:
        return len(self._calls)

    def begin(self, stream: StreamLike) -> None:
        """Before layer 0: the unfused step's copy of the positions (nothing when fused)."""
        step = self._current()
        if not step.fused and step.num_layers > 1:
            step._arrays["positions"][:self._lengths.shape[0]].copy_from(self._lengths, stream)

    def layer(self, index: int, stream: StreamLike) -> None:
        """Layer ``index``'s launches: append_and_run (fused), or append then attention."""
        self._current()
        for call in self._calls[index]:
            call.launch(stream)

    def end(self, stream: StreamLike) -> None:
        """After the last layer: the fused step's one ``advance_lengths`` (nothing unfused,
        where layer 0's append advanced them)."""
        step = self._current()
        if step.fused:
            step._advance(self._lengths, self._capacity, stream)

    def _current(self) -> DecodeStep:
        step = self._step
        step._require_open()
        if step.attention._generation != self._planned:
            raise RuntimeError("BoundStep: the step was planned again; bind the buffers anew")
        return step
