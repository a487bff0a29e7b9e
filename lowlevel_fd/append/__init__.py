"""The writes into the INT8 KV cache: the fused RoPE + quantize + append of one token per
sequence (AppendPlan) and the bulk write of whole prompts (PromptQuantizer)."""
from .plan import AppendPlan
from .prompt import PromptQuantizer, quantize_prompt
from .runner import PreparedAppend
from .variants import AppendVariant, shipped_variants

__all__ = ["AppendPlan", "AppendVariant", "PreparedAppend", "PromptQuantizer",
           "quantize_prompt", "shipped_variants"]
