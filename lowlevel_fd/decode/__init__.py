"""Decode attention over an INT8 KV cache: kernels' variants, the planner and DecodePlan."""
from .plan import KV_LAYOUTS, SCALE_MODES, DecodePlan, load_variant
from .planner import TileConfig, Workload, choose
from .variants import DecodeVariant, shipped_variants

__all__ = ["DecodePlan", "DecodeVariant", "KV_LAYOUTS", "SCALE_MODES", "TileConfig", "Workload",
           "choose", "load_variant", "shipped_variants"]
