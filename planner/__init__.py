"""Memory-feasibility planner: estimate(spec, arch, gpu) -> Plan (per-GPU breakdown, verdict, suggestions).

Model of the peak (per GPU), each piece a named Term with its assumption in `note`:
  persistent   base weights (+ NF4 constants; a MoE base's experts all resident, never quantized by
               bitsandbytes), LoRA adapters, gradients, optimizer states, master weights, cuBLAS workspaces
  fwd/bwd      activations saved for backward, autocast copies, FSDP all-gathered units, and the larger of
                 loss      the loss head's largest moment: ftune's chunked head (training.loss: one chunk of
                           scored tokens' vocab-sized buffers, the scored hidden states and their gradients),
                           or a plain head's logits + loss buffers at backward start (+ a cast lm_head copy)
                 layer     one block's worst moment: the recomputed layer (checkpointing) with its LoRA
                           branch's input copies, gradients in flight or flash attention's backward buffers,
                           QLoRA's dequantized weight
  step         paged optimizer states (paged in), AdamW temporaries, grad-norm buffers
  reference    objective dpo (sigmoid, ipo) and grpo with beta > 0: the reference policy's no-grad forward,
               which runs before the policy's and keeps no activation (its largest moment: the log-probs)
  rollouts     objective grpo: generate()'s sampling before the step trains, no grad: the KV cache of
               micro_batch_size x num_generations sequences of max_seq_len, with the decode step's sampling
               buffers or the prompts' prefill beside it (planner.rollouts)
  allocated = persistent + max(rollouts, fwd/bwd, step, reference)  -> max_memory_allocated
  reserved  = allocated + the caching allocator's cached free blocks  -> max_memory_reserved
              (fragmentation, and the segments batches of varying lengths leave: planner.allocator)
  total     = reserved + the CUDA context                           -> what the device must have (the verdict)
With objective dpo a micro-batch of n pairs is 2n sequences (chosen and rejected) in every term, and the
reference's two log-probs per pair are kept through forward and backward. With grpo a micro-batch of n
prompts is n x num_generations sequences (spec.sequences_per_example), padded to max_seq_len in the worst
case, of which only the completions (max_completion_tokens each) are scored by the loss head.
allocated_bytes is what a run measures: max_memory_allocated on CUDA, live tensor bytes on a CPU
(tests/training/test_planner_vs_measured.py holds it within 15% there), where reserved = allocated and
there is no context. A phase that is not the peak is listed with 0 bytes and its size in the note, so
terms sum to total.
Tokens: a micro-batch is planned at micro_batch_size x max_seq_len tokens, every position scored (the
worst case), until the job's token statistics give the data's largest micro-batch (BatchShape: its tokens,
widest sequence and scored tokens; the engine computes logits for scored positions only). The job is then
re-planned from it (models.replan), and placement and training's own prediction use it too.
What a training framework keeps beyond the JobSpec is a Runtime; FTUNE is ftune's engine (its chunked
loss head), the defaults a transformers/peft loop.
A plain loss head's half-precision logits segments, which its fp32 buffers cannot reuse, are reported
beside the total (loss_segments_bytes): cached blocks the allocator frees before an OOM.

Modules, in reading order:
  types             Term, Plan, Suggestion, Runtime: what goes in and comes out
  estimate          estimate(): the plan, with suggestions when it does not fit
  peak              adds the phases up into one Plan
  context           the dtypes, trainable parameters and tokens every section counts with
  memory            byte formulas: weight formats, what a block saves for backward, the loss heads
  moe               a mixture-of-experts block's own tensors: router, routed rows, LoRA'd expert stacks
  moe_terms         their terms in a plan (the stacks every layer keeps, the load-balancing loss's logits)
  state             persistent: base weights and trainable state
  forward_backward  fwd/bwd transients
  step              optimizer-step transients
  rollouts          grpo's sampling phase: the KV cache and generate()'s transients
  allocator         the caching allocator (reserved beyond allocated), cuBLAS workspaces, CUDA context
  speed             time per epoch
  suggest           changes that fit, for a job that does not
  gpus              the GPUs the planner knows
  feasibility       admission against the fleet: where a job fits best
  sharding          what an FSDP job may ask for
"""

from planner.estimate import estimate
from planner.types import FTUNE, BatchShape, Plan, Runtime, Suggestion, Term

__all__ = ["FTUNE", "BatchShape", "Plan", "Runtime", "Suggestion", "Term", "estimate"]
