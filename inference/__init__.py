"""ftune's inference engine: a long-lived, OpenAI-compatible HTTP process serving many LoRA adapters.

Why a process that speaks vLLM's API: the ftune API forwards `/v1/chat/completions` and loads adapters with
`/v1/load_lora_adapter` the same way whether FTUNE_INFERENCE_URL points at this embedded engine (the CPU
default, the demo model) or at a real `vllm serve --enable-lora`: one forwarding path, one contract, and
the production engine is a drop-in. A long-lived process (not a Celery task per request) keeps the base
model's weights loaded between requests and streams tokens as they are produced.

Memory: one copy of a base model's weights; adapters are attached to it with peft under their own names,
switched per request (`set_adapter`; the base itself with the adapter disabled), at most `--max-adapters`
resident per base (fewer when `--memory-bytes` and the planner's bound, planner.serving, say so), the
least recently used deleted from the peft model when another must load and reloaded from its path on next
use. On a CPU one base is loaded at a time.

Back-pressure: generation runs on one thread, so the event loop never blocks; at most `--max-waiting`
requests wait (429 engine_overloaded with Retry-After beyond that) and one that waits longer than
`--timeout-seconds` before it starts gets 504 engine_timeout.

Modules: server (HTTP, OpenAI shapes), scheduler (the bounded line and the generation thread), engine
(catalog, adapter registry, what is resident; one request alone), adapters (checking and attaching an
adapter), prompt (chat messages -> training's token ids), schemas (request bodies), errors; batcher
(continuous batching: rows of every running request decoded together). The decoding itself (prefill, the
padded KV cache, sampling, stop strings, each row's own adapter) is training.decoding's, the one engine
that chat, samples, evaluation and rollouts share.

OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE unless set; read when torch loads OpenMP, so it is
set here, before any torch import of this process): the engine shares its CPU, with training under `ftune
up`, and threads spinning at a barrier while another is descheduled made a batched step on a busy 2-core
machine 100x slower (a 3-row step of the tiny model: 250 ms spinning, 1.8 ms passive).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
