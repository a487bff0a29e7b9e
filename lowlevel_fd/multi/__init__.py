"""Multi-token attention over the INT8 cache (prefill, chunked prefill, speculative
verification): the planner, the kernel's programs and MultiPlan."""
from .plan import MultiPlan
from .planner import MultiWorkload, choose_splits, int8_q_decode_pays
from .prepared import PreparedRun
from .variants import MultiVariant, shipped_variants

__all__ = ["MultiPlan", "MultiVariant", "PreparedRun", "MultiWorkload", "choose_splits",
           "int8_q_decode_pays", "shipped_variants"]
