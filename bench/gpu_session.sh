#!/usr/bin/env bash
# One GPU session in ~9 minutes, run from the repository root on a lent CUDA machine whose python3
# already has torch, transformers, peft, accelerate, numpy, pandas, pyarrow, tokenizers, safetensors.
# A session is lent 15 minutes of device time, the machine's start included (~35 s on 2026-11-27), so
# make two calls, the second at once after the first (the machine goes back after 30 s idle) and reusing
# its 1.1B model:
#
#     WORK=/tmp/ftune-gpu TOTAL=570 KERNELS=0 bash bench/gpu_session.sh                          # timeout_s 600
#     WORK=/tmp/ftune-gpu TOTAL=230 KERNELS=0 FUSED=0 SFT=0 PREFLIGHT=0 GRPO=1 bash bench/gpu_session.sh
#                                                                           # timeout_s 250, or what is left
#
# (2026-11-27, H200: building the 1.1B model ~35 s, a gpu_vs_trl run 40-60 s, a gpu_check config ~36 s,
# rollouts_decode ~160 s for its 6 rows, 3 with --now.)
#
# .whl/ is git-ignored (.git/info/exclude): `bash bench/gpu_wheels.sh` fills it here, and a device call must
# carry it (carry: [".whl"]).
# 1. installs the wheels in .whl/ (what that python lacks: pydantic and its parts, pydantic-settings,
#    trl, datasets, dill, multiprocess, bitsandbytes; downloaded beforehand, nothing is fetched here)
#    into /tmp/site, ahead of the machine's packages on PYTHONPATH (.whl/decode/: transformers 5.24.0 and
#    huggingface-hub 1.31.0, for rollouts_decode alone: ~14 MB of the call's 64 MiB);
# 2. prints nvidia-smi and the versions of what will run, then runs bench/gpu_preflight.py (each kind of
#    job on a tiny model; PREFLIGHT=0 leaves it out) and stops there if one fails;
# 3. bench/gpu_kernels.py (packed attention's kernel, the chunked loss head, host syncs; KERNELS=0 leaves
#    it out), then bench/fused_ops.py (the fused norm, gate and rotary embedding, compiled and eager,
#    against the modules' own; FUSED=0 leaves it out), each under a timeout;
# 4. bench/gpu_vs_trl.py --eager-layers (ftune against TRL's SFTTrainer, its decoder layers compiled, and
#    with them eager), under a timeout; CKPT=1 adds a pass with gradient checkpointing on, if time is left;
# 5. bench/gpu_check.py --steps 6 (the planner against the engine), under a timeout, reusing that model,
#    then bench/step_profile.py (where the 1.1B step's time goes, by kernel; PROFILE=0 leaves it out);
#    (SFT=0 leaves steps 4 and 5 out.)
# 6. GRPO=1: bench/gpu_grpo.py --steps 3 (objective grpo: its phases and the planner; GRPO_SHARE seconds
#    are left for this part by steps 4 and 5), bench/rollouts_decode.py --now (ms per decoding step: the
#    engine's rollouts against transformers alone and with a static cache, which transformers compiles with
#    CUDA graphs; it needs transformers 5.24: the wheels in .whl/decode/, if any, are put first for it) and
#    bench/lora_layer.py (us per call of one LoRA linear at the 1.1B's width), each if time is left.
# Everything goes to $OUT/log.txt; results to $OUT/gpu_check.json, $OUT/gpu_vs_trl.json
# ($OUT/gpu_vs_trl_ckpt.json, $OUT/gpu_grpo.json), $OUT/run_details.json (each gpu_vs_trl run's step records) and
# $OUT/runs_tail.txt (the end of each of its training processes' logs).
set -u
OUT=${OUT:-$PWD/out}
WHL=${WHL:-.whl}      # the wheels to install
SITE=${SITE:-/tmp/site}  # where they go
TOTAL=${TOTAL:-530}  # seconds for all of it: each part's timeout comes out of what is left
mkdir -p "$OUT"
# WORK: where models and runs go; name one to reuse its 1.1B model in a later call on the same machine
WORK=${WORK:-$(mktemp -d /tmp/ftune-gpu-session-XXXXXX)}
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

left() { echo $((TOTAL - SECONDS)); }
# timeout for a part: its share, but never past the end, and leaving `reserve` seconds for what follows
part_timeout() {
  local share=$1 reserve=$2 t
  t=$(($(left) - reserve))
  ((t > share)) && t=$share
  ((t < 1)) && t=1  # no time left: the part is stopped at once
  echo $t
}

session() {
  echo "== install ($WHL -> $SITE) at ${SECONDS}s"
  ls -l "$WHL"
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHL"/*.whl; then
    echo "pip install failed; unpacking the wheels instead"
    python3 -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[2]) for w in sorted(glob.glob(sys.argv[1] + '/*.whl'))]" "$WHL" "$SITE"
  fi
  export PYTHONPATH=$SITE:$PWD

  echo "== versions at ${SECONDS}s"
  nvidia-smi || echo "nvidia-smi failed"
  timeout -k 5 90 python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ["torch", "transformers", "peft", "accelerate", "trl", "datasets", "huggingface_hub", "tokenizers",
             "safetensors", "pydantic", "pydantic_core", "typing_extensions", "numpy", "pandas", "pyarrow",
             "fsspec", "dill", "multiprocess", "bitsandbytes"]:
    try:
        mod = importlib.import_module(name)
        print(f"{name:18} {getattr(mod, '__version__', '?'):14} {mod.__file__}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:18} IMPORT FAILED: {type(e).__name__}: {e}")
import torch
print("torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
      "| bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
from transformers.utils import is_flash_attn_2_available
print("flash_attn_2 available:", is_flash_attn_2_available())
import core.run_protocol, training.run  # noqa: F401  the engine's imports resolve
from trl import SFTConfig, SFTTrainer  # noqa: F401
print("imports ok: core, training.run, trl.SFTTrainer")
EOF

  # does the training fork server (worker.forking) serve on a CUDA build, or decline (libcuda mapped at import)?
  echo "== training.forkserver on this machine at ${SECONDS}s"
  timeout -k 5 60 python3 -m training.forkserver "$WORK/forkserver.sock" < /dev/null | head -n 1

  # every kind of job on a tiny model first (~15 s): an engine error on this device then costs seconds,
  # not every bench below (2026-11-27: each job of a 7-minute call failed at its first CUDA line)
  if [ "${PREFLIGHT:-1}" = 1 ]; then
    echo "== bench/gpu_preflight.py at ${SECONDS}s"
    if ! timeout -k 5 120 python3 bench/gpu_preflight.py --keep "$WORK/preflight"; then
      echo "== preflight failed at ${SECONDS}s: nothing else runs (fix it here, then call again)"
      return 1
    fi
  fi

  local t
  if [ "${KERNELS:-1}" = 1 ]; then  # KERNELS=0: leave it out (a shorter rerun)
    t=$(part_timeout 75 420)
    echo "== bench/gpu_kernels.py (timeout ${t}s) at ${SECONDS}s"
    timeout -k 10 "$t" python3 bench/gpu_kernels.py
    echo "gpu_kernels exit $? at ${SECONDS}s"
  fi
  if [ "${FUSED:-1}" = 1 ]; then  # FUSED=0: leave it out
    t=$(part_timeout 60 300)
    echo "== bench/fused_ops.py (timeout ${t}s) at ${SECONDS}s"
    timeout -k 10 "$t" python3 bench/fused_ops.py
    echo "fused_ops exit $? at ${SECONDS}s"
  fi

  # what the SFT part leaves for the grpo part when both run in one call
  local sft_tail=10
  [ "${GRPO:-0}" = 1 ] && sft_tail=${GRPO_SHARE:-170}
  if [ "${SFT:-1}" = 1 ]; then  # SFT=0: leave gpu_vs_trl and gpu_check out (e.g. GRPO=1 SFT=0: grpo only)
    # gpu_vs_trl first (the speed goal, and the decoder layers compiled or eager on the whole step); it
    # builds the 1.1B model where gpu_check then finds it
    t=$(part_timeout 260 $((sft_tail + 120)))
    echo "== bench/gpu_vs_trl.py --eager-layers (timeout ${t}s) at ${SECONDS}s"
    timeout -k 15 "$t" python3 bench/gpu_vs_trl.py --eager-layers --keep "$WORK/vs" \
      --models "$WORK/check/models" --budget $((t - 25)) --run-timeout 150 --json-out "$OUT/gpu_vs_trl.json"
    echo "gpu_vs_trl exit $? at ${SECONDS}s"

    t=$(part_timeout 200 "$sft_tail")  # its lora config compiles its layers (~15 s on an H200)
    echo "== bench/gpu_check.py --steps 6 (timeout ${t}s) at ${SECONDS}s"
    timeout -k 15 "$t" python3 bench/gpu_check.py --steps 6 --keep "$WORK/check" | tee "$WORK/gpu_check.out"
    echo "gpu_check exit ${PIPESTATUS[0]} at ${SECONDS}s"
    grep '^\[{"config"' "$WORK/gpu_check.out" | tail -1 > "$OUT/gpu_check.json"

    if [ "${PROFILE:-1}" = 1 ] && (($(left) > sft_tail + 40)); then  # PROFILE=0: leave it out
      t=$(part_timeout 90 "$sft_tail")
      echo "== bench/step_profile.py (timeout ${t}s) at ${SECONDS}s"
      timeout -k 10 "$t" python3 bench/step_profile.py --models "$WORK/check/models"
      echo "step_profile exit $? at ${SECONDS}s"
    fi

    if [ "${CKPT:-0}" = 1 ] && (($(left) > 150)); then
      t=$(part_timeout 330 10)
      echo "== bench/gpu_vs_trl.py --checkpointing (timeout ${t}s) at ${SECONDS}s"
      timeout -k 15 "$t" python3 bench/gpu_vs_trl.py --checkpointing --keep "$WORK/vs-ckpt" \
        --models "$WORK/check/models" --budget $((t - 25)) --run-timeout 120 \
        --json-out "$OUT/gpu_vs_trl_ckpt.json"
      echo "gpu_vs_trl --checkpointing exit $? at ${SECONDS}s"
    fi
  fi

  if [ "${GRPO:-0}" = 1 ] && (($(left) > 60)); then
    # gpu_grpo first: its timing is known (~35 s a config); the static-cache row of rollouts_decode compiles
    t=$(part_timeout 170 80)  # 80 s left for rollouts_decode's three rows
    echo "== bench/gpu_grpo.py --steps 3 (timeout ${t}s) at ${SECONDS}s"
    timeout -k 15 "$t" python3 bench/gpu_grpo.py --steps 3 --keep "$WORK/grpo" --models "$WORK/check/models" \
      --json "$OUT/gpu_grpo.json"
    echo "gpu_grpo exit $? at ${SECONDS}s"
    # the static cache needs transformers >= 5.24 (training.rollouts): wheels in .whl/decode/ (transformers
    # and the huggingface-hub it needs) are put ahead of the rest for this bench alone
    local decode_path=$PYTHONPATH
    if ls "$WHL"/decode/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-decode "$WHL"/decode/*.whl && decode_path=/tmp/site-decode:$PYTHONPATH
    fi
    t=$(part_timeout 200 "${LORA_LAYER_SHARE:-0}")
    echo "== bench/rollouts_decode.py --repeats 1 --now (timeout ${t}s) at ${SECONDS}s"
    PYTHONPATH=$decode_path timeout -k 10 "$t" python3 bench/rollouts_decode.py --repeats 1 --now \
      --models "$WORK/check/models"
    echo "rollouts_decode exit $? at ${SECONDS}s"
    if (($(left) > 20)); then
      t=$(part_timeout 40 0)
      echo "== bench/lora_layer.py --width 2048 (timeout ${t}s) at ${SECONDS}s"
      timeout -k 5 "$t" python3 bench/lora_layer.py --width 2048
      echo "lora_layer exit $? at ${SECONDS}s"
    fi
  fi

  for d in "$WORK"/vs*/*/; do
    [ -f "$d/log.txt" ] && { echo "===== $d"; tail -n 40 "$d/log.txt"; }
  done > "$OUT/runs_tail.txt" 2>&1
  python3 - "$WORK" "$OUT/run_details.json" <<'EOF'
import json, pathlib, sys
work, details = pathlib.Path(sys.argv[1]), {}
for d in sorted(p for p in work.glob("vs*/*") if p.is_dir() and p.name != "models"):
    entry = {}
    if (d / "metrics.jsonl").exists():
        entry["metrics"] = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for name in ("trl_result.json", "cuda_peaks.json"):
        if (d / name).exists():
            entry[name] = json.loads((d / name).read_text())
    details[f"{d.parent.name}/{d.name}"] = entry
pathlib.Path(sys.argv[2]).write_text(json.dumps(details))
EOF
  echo "== done at ${SECONDS}s"
}

session 2>&1 | tee "$OUT/log.txt"
