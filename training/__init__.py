"""The ML engine. Runs as `python -m training.run <run.json>`; imports core/, never api/worker/models.

Entry points used by the rest of ftune:
  training.run.main(argv) / run(config, stop)   train one job (exit codes 0 done, 1 failed, 3 stopped)
  training.demo.build_demo_model(models_dir, name="ftune-demo", force=False) -> Path
  python -m training.token_stats ...            a job's token statistics, counted as training counts

Modules: run (the process: exit codes, errors), recipe (setup -> train -> finish, the loop), data
(examples -> ids + labels), batches (each step's global batch, then its micro-batches and ranks),
packing (packed micro-batches, attention per example), dropout (LoRA dropout per example), step (one
optimizer step), model (base + LoRA/QLoRA, mixed precision), evaluate, checkpoint (atomic save /
resume), export (adapter, merged model), metrics (metrics.jsonl writer), memory (peak memory),
distributed (FSDP2 ranks under torchrun).
"""
