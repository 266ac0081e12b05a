"""The one decoding engine: prompts prefilled, then one token per row per step until every row ends.

Everything in ftune that generates text decodes here: chat completions (inference.batcher, continuous
batching; inference.engine, one request at a time), before/after samples (training.samples), GRPO's
rollouts and its evaluation (training.rollouts). The parts:
  - engine: `Row` (one sequence: its sampling, end tokens, stop strings, adapter, tokens, log-probs) and
    `Decoder` (prefill, the step, rows leaving or staying), `decode` (a fixed batch to its end)
  - kv: the rows' KV cache (a padded DynamicCache; a StaticCache for compiled decoding on a GPU)
  - sampling: each row's next token (greedy, temperature, top_p; per-row generators or one batch draw)
  - text: generated ids -> text, stop strings, pieces released as soon as they are text
  - lora_rows: each row's own LoRA adapter in one forward (a serving model's)
It lives under training because the inference engine may import training and not the other way round
(the import-linter contracts); it imports nothing of training but training.packing's attention switch.
"""
