"""Decode attention over an INT8 KV cache: the planner, the kernels' programs and DecodePlan."""
from .plan import DecodePlan
from .prepared import PreparedCall
from .planner import TileConfig, Workload, choose
from .variants import CombineVariant, DecodeVariant, shipped_variants

__all__ = ["CombineVariant", "DecodePlan", "DecodeVariant", "PreparedCall", "TileConfig",
           "Workload", "choose", "shipped_variants"]
