"""A MultiPlan call validated once (``MultiPlan.prepare_run``): ``launch(stream)`` issues the
plan's launches with these arguments and no further checks."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from ..driver.stream import StreamLike
from .maps import Q8Maps
from .params import MultiParams

if TYPE_CHECKING:
    from .plan import MultiPlan


class PreparedRun:
    """A validated call of a MultiPlan: ``launch(stream)`` issues it, valid until the plan is
    planned again or closed."""

    __slots__ = ("_plan", "_params", "_maps", "_rows", "_generation")

    def __init__(self, plan: MultiPlan, params: MultiParams, maps: Q8Maps, rows: bool) -> None:
        self._plan, self._params, self._maps, self._rows = plan, params, maps, rows
        self._generation = plan._generation

    def launch(self, stream: StreamLike) -> None:
        plan = self._plan
        plan._require_open()
        if self._generation != plan._generation:
            raise RuntimeError("PreparedRun: the plan was planned again; prepare the call anew")
        ctypes.memmove(ctypes.addressof(plan._params), ctypes.addressof(self._params),
                       ctypes.sizeof(MultiParams))
        ctypes.memmove(ctypes.addressof(plan._maps), ctypes.addressof(self._maps),
                       ctypes.sizeof(Q8Maps))
        if self._rows:
            plan._launch.launch(stream)  # type: ignore[union-attr]
            if plan._combine is not None:
                plan._combine.launch(stream)
