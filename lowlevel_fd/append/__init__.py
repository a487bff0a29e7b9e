"""The decode step's writes into the INT8 KV cache: the fused RoPE + quantize + append of one
token per sequence (AppendPlan) and the bulk write of whole prompts (PromptQuantizer)."""
from .params import ERROR_POSITION_OUTSIDE_CACHE, ERROR_PROMPT_LENGTH
from .plan import AppendPlan
from .prompt import PromptQuantizer, quantize_prompt
from .runner import KV_LAYOUTS
from .variants import AppendVariant, load_variant, shipped_variants

__all__ = ["AppendPlan", "AppendVariant", "ERROR_POSITION_OUTSIDE_CACHE", "ERROR_PROMPT_LENGTH",
           "KV_LAYOUTS", "PromptQuantizer", "load_variant", "quantize_prompt",
           "shipped_variants"]
