"""A DecodePlan call validated once (``prepare_run``, ``prepare_append_and_run``): what
DecodeStep and graph builders issue without re-checking."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from ..append import PreparedAppend
from ..driver.stream import StreamLike
from ..multi import PreparedRun
from .params import DecodeParams

if TYPE_CHECKING:
    from .plan import DecodePlan


class PreparedCall:
    """A validated call of a DecodePlan: ``launch(stream)`` issues it, valid until the plan is
    planned again or closed."""

    __slots__ = ("_plan", "_params", "_append", "_generation", "_routed")

    def __init__(self, plan: DecodePlan, params: DecodeParams, append: bool,
                 routed: tuple[PreparedAppend | PreparedRun, ...] = ()) -> None:
        self._plan, self._params, self._append = plan, params, append
        self._generation, self._routed = plan._generation, routed

    def launch(self, stream: StreamLike) -> None:
        plan = self._plan
        plan._require_open()
        if self._generation != plan._generation:
            raise RuntimeError("PreparedCall: the plan was planned again; prepare the call anew")
        if self._routed:  # the multi-token route's launches, in order
            for call in self._routed:
                call.launch(stream)
            return
        ctypes.memmove(ctypes.addressof(plan._params), ctypes.addressof(self._params),
                       ctypes.sizeof(DecodeParams))
        plan._launch(self._append, stream)

