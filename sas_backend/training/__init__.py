"""Gate training for SAS (frozen backbone, trainable gates).

`scoring` (log g + Top-K threshold), `model` (gates on a transformers Llama/Qwen2/Qwen3),
`data` (corpora, split, packing), `train` (the CLI), `eval_ppl` (held-out perplexity table),
`ops.gated_attention` (the fused kernel and its torch reference). See README.md here.
"""
