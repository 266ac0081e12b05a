"""The ML engine. Runs as `python -m training.run <run.json>`; imports core/, never api/worker/models.

Entry points used by the rest of ftune:
  training.run.main(argv) / run(config, stop)   train one job (exit codes 0 done, 1 failed, 3 stopped)
  training.demo.build_demo_model(models_dir, name="ftune-demo", force=False) -> Path
  training.metrics.read_metrics(path)           metrics.jsonl records with superseded steps dropped

Modules: data (examples -> ids + labels -> batches), model (base + LoRA/QLoRA), loop (the step),
checkpoint (atomic save / resume), metrics (metrics.jsonl), memory (peak memory), distributed (FSDP2
ranks under torchrun), run (the process).
"""
