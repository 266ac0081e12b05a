#!/usr/bin/env bash
# One GPU session (issue 45: ftune against TRL at its fastest and Unsloth, MFU by the LoRA count, the 8B
# shape), run from the repository root on a lent CUDA machine whose python3 already has torch,
# transformers, peft, accelerate, numpy, pandas, pyarrow, tokenizers, safetensors. A session is lent 15
# minutes of device time, each machine start included (~35 s on 2026-11-27), so it makes two calls, the
# second at once after the first (the machine goes back when idle), reusing the first's models in WORK:
#
#     bash bench/gpu_wheels.sh       # here, first: fills .whl/ (~41 MiB)
#     run(command="WORK=/tmp/ftune-gpu TOTAL=570 bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
#     run(command="WORK=/tmp/ftune-gpu TOTAL=230 PREFLIGHT=0 PARTS='ckpt 8b' CONFIGS_8B=qlora-8b \
#                  bash bench/gpu_session.sh", carry=[".whl"], timeout_s=250)   # or what is left
#
# (call 2: name in CONFIGS_8B the 8B configs call 1 did not finish, or leave 8b out of PARTS; a part whose
# output file call 1 wrote in full need not run again.)
#
# What runs, in order (each part under a timeout: its share, never past TOTAL; a part with too little time
# left is skipped and says so). The times are ESTIMATES, not measurements: from 2026-11-28's H200 log
# (model build 35 s, a gpu_vs_trl run 25-45 s, TRL's plain step 678 ms, the engine's first step compiling its
# layers in ~15 s) and guesses for what has never run there (TRL's whole-model torch.compile with Liger:
# guessed 40-80 s of compiling per run; Unsloth's import: 10-30 s; the 8B: ~30 s to write its 16 GB, ~20 s
# to load, steps of ~0.6 s):
#   install + versions (~25 s), then bench/gpu_preflight.py (~30 s; PREFLIGHT=0 leaves it out), while the
#   1.1B and the 8B models are built in the background (gpu_check.py --build-only; measured parts wait
#   for them: ~40 s estimated, so hidden behind the preflight);
#   PARTS (default "lora qlora 8b"; without PARTS the earlier switches still work: SFT=0 leaves the
#   default parts out, KERNELS=1 and FUSED=1 put those benches first, GRPO=1 adds "grpo decode lora_layer"),
#   each of:
#     lora   bench/gpu_vs_trl.py, 1.1B, LoRA, packed 8 x 1024, no checkpointing, RUNS_LORA (default
#            "ftune packed,trl fastest,unsloth,trl packed,trl fastest sdpa,trl fastest bf16": the last two
#            as the budget allows; "trl fastest sdpa" only where "trl fastest" picked another attention),
#            STEPS (20) steps, the first WARMUP (3) not timed -> $OUT/gpu_vs_trl.json
#                                                                                share 260 s (est. 230-330)
#     qlora  the same with --qlora, RUNS_QLORA ("ftune packed,trl fastest,unsloth,trl packed")
#            -> $OUT/gpu_vs_trl_qlora.json                                       share 170 s (est. 160-250)
#     ckpt   the same with --checkpointing, RUNS_CKPT (as qlora's) -> $OUT/gpu_vs_trl_ckpt.json
#                                                                                share 170 s (est. 160-250)
#     8b     bench/gpu_check.py --shape 8b: Llama-3-8B-shaped, LoRA and QLoRA (CONFIGS_8B, default
#            "lora-8b,qlora-8b"), packed 2 x 4096, 8 steps, 2 not timed; the planner's prediction beside
#            max_memory_reserved -> $OUT/gpu_check_8b.json                       share 200 s (est. 130-200)
#     check  bench/gpu_check.py --steps 6 (the 1.1B planner check of earlier sessions) -> gpu_check.json
#     moe, vl  bench/gpu_check.py --shape moe|vl: the planner on a random Qwen3-MoE (~1.4B, 16 experts) and
#            Qwen2.5-VL (~1B) against max_memory_reserved (issue 43) -> gpu_check_moe.json, _vl.json
#                                                                                share 150 s each (guess)
#     profile, kernels, fused, grpo, decode, lora_layer: the benches of earlier sessions (step_profile.py,
#            gpu_kernels.py, fused_ops.py, gpu_grpo.py, rollouts_decode.py --now with .whl/decode first,
#            lora_layer.py), each with its earlier share
#   Estimated: call 1 reaches lora and qlora, and 8b's lora-8b (qlora-8b if the compiles are quick); call 2
#   runs ckpt and what is left of 8b. Unsloth: once a part finds it unavailable, later parts drop its row
#   (the reason is in the first part's table).
# .whl/ is git-ignored (.git/info/exclude): bench/gpu_wheels.sh fills it here; every call carries it. Its
# top-level wheels go to /tmp/site, ahead of the machine's packages on PYTHONPATH; .whl/unsloth/ to
# /tmp/site-unsloth (UNSLOTH_SITE: first on the Unsloth runs' PYTHONPATH alone, for its pinned TRL 1.15
# and datasets 4.8); .whl/decode/ to /tmp/site-decode for rollouts_decode alone.
# Everything goes to $OUT/log.txt; each run's step records and results to $OUT/run_details.json and the end
# of each training process's log to $OUT/runs_tail.txt.
set -u
OUT=${OUT:-$PWD/out}
WHL=${WHL:-.whl}         # the wheels to install
SITE=${SITE:-/tmp/site}  # where they go
TOTAL=${TOTAL:-570}      # seconds for all of it: each part's timeout comes out of what is left
if [ -z "${PARTS:-}" ]; then  # the default, and the switches of the sessions before issue 45
  PARTS="lora qlora 8b"
  [ "${SFT:-1}" = 0 ] && PARTS=""                        # SFT=0: no gpu_vs_trl, no gpu_check
  [ "${FUSED:-0}" = 1 ] && PARTS="fused $PARTS"           # FUSED=1, KERNELS=1: those benches first
  [ "${KERNELS:-0}" = 1 ] && PARTS="kernels $PARTS"
  [ "${GRPO:-0}" = 1 ] && PARTS="$PARTS grpo decode lora_layer"
fi
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-3}  # gpu_vs_trl's steps not timed (a dry run on a CPU, whose smoke trains 3: WARMUP=1)
RUNS_LORA=${RUNS_LORA:-ftune packed,trl fastest,unsloth,trl packed,trl fastest sdpa,trl fastest bf16}
RUNS_QLORA=${RUNS_QLORA:-ftune packed,trl fastest,unsloth,trl packed}
RUNS_CKPT=${RUNS_CKPT:-ftune packed,trl fastest,unsloth,trl packed}
CONFIGS_8B=${CONFIGS_8B:-lora-8b,qlora-8b}
mkdir -p "$OUT"
# WORK: where models and runs go; name one to reuse its models in a later call on the same machine
WORK=${WORK:-$(mktemp -d /tmp/ftune-gpu-session-XXXXXX)}
MODELS=$WORK/models
mkdir -p "$WORK" "$MODELS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

left() { echo $((TOTAL - SECONDS)); }
# timeout for a part: its share, but never past the end (less 5 s for the files at the end)
part_timeout() {
  local t=$(($(left) - 5))
  ((t > $1)) && t=$1
  echo $t
}
has_part() { [[ " $PARTS " == *" $1 "* ]]; }

install() {
  echo "== install ($WHL -> $SITE) at ${SECONDS}s"
  ls -l "$WHL" "$WHL"/*/ 2>/dev/null
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHL"/*.whl; then
    echo "pip install failed; unpacking the wheels instead"
    python3 -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[2]) for w in sorted(glob.glob(sys.argv[1] + '/*.whl'))]" "$WHL" "$SITE"
  fi
  export PYTHONPATH=$SITE:$PWD
  # ftune's decoding engine (training/decoding) is exact from transformers 5.24 on (pyproject's floor): the
  # machine's 5.17 would sample rollouts and samples differently, so .whl/decode's 5.24 goes first for all
  if ls "$WHL"/decode/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHL"/decode/*.whl || echo "transformers 5.24 did not install: engine samples may differ"
  fi
  if ls "$WHL"/unsloth/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site-unsloth "$WHL"/unsloth/*.whl && export UNSLOTH_SITE=/tmp/site-unsloth
  fi
  echo "UNSLOTH_SITE=${UNSLOTH_SITE:-(none: the unsloth rows will say unavailable)}"
}

versions() {
  echo "== versions at ${SECONDS}s"
  nvidia-smi || echo "nvidia-smi failed"
  timeout -k 5 90 python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ["torch", "triton", "transformers", "peft", "accelerate", "trl", "datasets", "huggingface_hub",
             "tokenizers", "safetensors", "pydantic", "pydantic_core", "numpy", "pandas", "pyarrow", "fsspec",
             "dill", "multiprocess", "bitsandbytes", "liger_kernel", "PIL", "requests", "regex", "psutil",
             "xformers", "flash_attn", "kernels"]:
    try:
        mod = importlib.import_module(name)
        print(f"{name:18} {getattr(mod, '__version__', '?'):14} {mod.__file__}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:18} IMPORT FAILED: {type(e).__name__}: {e}")
import torch
print("torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
      "| bf16", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
import transformers.utils as tu
print("flash_attn_2:", tu.is_flash_attn_2_available(), "| flash_attn_3:",
      getattr(tu, "is_flash_attn_3_available", lambda: "?")(), "| flex:", tu.is_torch_flex_attn_available(),
      "| liger:", tu.is_liger_kernel_available())
import core.run_protocol, training.run  # noqa: F401  the engine's imports resolve
from trl import SFTConfig, SFTTrainer  # noqa: F401
print("imports ok: core, training.run, trl.SFTTrainer")
EOF
  if [ "${FORKSERVER:-0}" = 1 ]; then  # measured 2026-11-27/28: it declines on this machine's CUDA build
    echo "== training.forkserver on this machine at ${SECONDS}s"
    timeout -k 5 60 python3 -m training.forkserver "$WORK/forkserver.sock" < /dev/null | head -n 1
  fi
}

BUILDS=()
build_models() {  # in the background, beside the preflight: the measured parts wait for them (wait_builds)
  if has_part lora || has_part qlora || has_part ckpt || has_part check || has_part profile || has_part grpo; then
    python3 bench/gpu_check.py --build-only --models "$MODELS" > "$WORK/build-1b.log" 2>&1 &
    BUILDS+=($!)
    echo "== building the 1.1B model in the background (pid $!) at ${SECONDS}s"
  fi
  if has_part 8b; then
    python3 bench/gpu_check.py --build-only --shape 8b --models "$MODELS" --keep "$WORK/check-8b" \
      > "$WORK/build-8b.log" 2>&1 &
    BUILDS+=($!)
    echo "== building the 8B model in the background (pid $!) at ${SECONDS}s"
  fi
}
wait_builds() {  # each build ~40 s (estimate); given up after 150 s
  local pid n
  for pid in "${BUILDS[@]}"; do
    n=0
    while kill -0 "$pid" 2> /dev/null && ((n < 150)); do sleep 1; n=$((n + 1)); done
    if kill -0 "$pid" 2> /dev/null; then
      kill "$pid"
      echo "model build $pid still running after ${n}s more: stopped"
    fi
    wait "$pid"
    echo "model build $pid exit $? at ${SECONDS}s"
  done
  BUILDS=()
  tail -n 3 "$WORK"/build-*.log 2> /dev/null
}

# Once a part's table says Unsloth is unavailable, the later parts leave its row out (saving its import).
UNSLOTH_UNAVAILABLE=0
note_unsloth() {
  [ -f "$1" ] || return 0
  if python3 -c "import json, sys; r = json.load(open(sys.argv[1])); sys.exit(0 if any(x.get('unavailable') for x in r['runs'] if x['engine'] == 'unsloth') else 1)" "$1"; then
    UNSLOTH_UNAVAILABLE=1
    echo "unsloth unavailable (see the table above): later parts leave its row out"
  fi
}
runs_for() {  # the runs of a part, less Unsloth's once it was found unavailable
  if [ "$UNSLOTH_UNAVAILABLE" = 1 ]; then
    echo "$1" | tr ',' '\n' | grep -vx 'unsloth' | paste -sd, -
  else
    echo "$1"
  fi
}

vs_part() {  # NAME SHARE JSON RUNS FLAGS...
  local name=$1 share=$2 json=$3 runs t
  runs=$(runs_for "$4")
  shift 4
  t=$(part_timeout "$share")
  if ((t < 60)); then
    echo "== $name: skipped, ${t}s left at ${SECONDS}s"
    return
  fi
  echo "== bench/gpu_vs_trl.py $* --runs '$runs' (part $name, timeout ${t}s) at ${SECONDS}s"
  timeout -k 15 "$t" python3 bench/gpu_vs_trl.py "$@" --runs "$runs" --steps "$STEPS" --warmup "$WARMUP" \
    --keep "$WORK/vs-$name" --models "$MODELS" --budget $((t - 20)) --run-timeout 170 --json-out "$OUT/$json"
  echo "gpu_vs_trl ($name) exit $? at ${SECONDS}s"
  note_unsloth "$OUT/$json"
}

part() {
  local t
  case $1 in
    lora) vs_part lora 260 gpu_vs_trl.json "$RUNS_LORA" ;;
    qlora) vs_part qlora 170 gpu_vs_trl_qlora.json "$RUNS_QLORA" --qlora ;;
    ckpt) vs_part ckpt 170 gpu_vs_trl_ckpt.json "$RUNS_CKPT" --checkpointing ;;
    8b)
      t=$(part_timeout 200)
      if ((t < 60)); then echo "== 8b: skipped, ${t}s left at ${SECONDS}s"; return; fi
      echo "== bench/gpu_check.py --shape 8b --configs $CONFIGS_8B (timeout ${t}s) at ${SECONDS}s"
      timeout -k 15 "$t" python3 bench/gpu_check.py --shape 8b --configs "$CONFIGS_8B" --steps 8 --warmup 2 \
        --models "$MODELS" --keep "$WORK/check-8b" --json-out "$OUT/gpu_check_8b.json"
      echo "gpu_check 8b exit $? at ${SECONDS}s"
      ;;
    moe|vl)  # issue 43: the planner on the new families (a random ~1.4B Qwen3-MoE, a ~1B Qwen2.5-VL)
      t=$(part_timeout 150)
      if ((t < 60)); then echo "== $1: skipped, ${t}s left at ${SECONDS}s"; return; fi
      echo "== bench/gpu_check.py --shape $1 --steps 6 (timeout ${t}s) at ${SECONDS}s"
      timeout -k 15 "$t" python3 bench/gpu_check.py --shape "$1" --steps 6 --models "$MODELS" \
        --keep "$WORK/check-$1" --json-out "$OUT/gpu_check_$1.json"
      echo "gpu_check $1 exit $? at ${SECONDS}s"
      ;;
    check)
      t=$(part_timeout 200)
      echo "== bench/gpu_check.py --steps 6 (timeout ${t}s) at ${SECONDS}s"
      timeout -k 15 "$t" python3 bench/gpu_check.py --steps 6 --models "$MODELS" --keep "$WORK/check" \
        --json-out "$OUT/gpu_check.json"
      echo "gpu_check exit $? at ${SECONDS}s"
      ;;
    profile)
      t=$(part_timeout 90)
      echo "== bench/step_profile.py (timeout ${t}s) at ${SECONDS}s"
      timeout -k 10 "$t" python3 bench/step_profile.py --models "$MODELS"
      echo "step_profile exit $? at ${SECONDS}s"
      ;;
    kernels)
      t=$(part_timeout 75)
      echo "== bench/gpu_kernels.py (timeout ${t}s) at ${SECONDS}s"
      timeout -k 10 "$t" python3 bench/gpu_kernels.py
      echo "gpu_kernels exit $? at ${SECONDS}s"
      ;;
    fused)
      t=$(part_timeout 60)
      echo "== bench/fused_ops.py (timeout ${t}s) at ${SECONDS}s"
      timeout -k 10 "$t" python3 bench/fused_ops.py
      echo "fused_ops exit $? at ${SECONDS}s"
      ;;
    grpo)
      t=$(part_timeout 170)
      echo "== bench/gpu_grpo.py --steps 3 (timeout ${t}s) at ${SECONDS}s"
      timeout -k 15 "$t" python3 bench/gpu_grpo.py --steps 3 --keep "$WORK/grpo" --models "$MODELS" \
        --json "$OUT/gpu_grpo.json"
      echo "gpu_grpo exit $? at ${SECONDS}s"
      ;;
    decode)  # the static cache needs transformers >= 5.24 (training.rollouts): .whl/decode/ first
      local decode_path=$PYTHONPATH
      if ls "$WHL"/decode/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/site-decode "$WHL"/decode/*.whl && decode_path=/tmp/site-decode:$PYTHONPATH
      fi
      t=$(part_timeout 200)
      echo "== bench/rollouts_decode.py --repeats 1 --now (timeout ${t}s) at ${SECONDS}s"
      PYTHONPATH=$decode_path timeout -k 10 "$t" python3 bench/rollouts_decode.py --repeats 1 --now \
        --models "$MODELS"
      echo "rollouts_decode exit $? at ${SECONDS}s"
      ;;
    lora_layer)
      t=$(part_timeout 40)
      echo "== bench/lora_layer.py --width 2048 (timeout ${t}s) at ${SECONDS}s"
      timeout -k 5 "$t" python3 bench/lora_layer.py --width 2048
      echo "lora_layer exit $? at ${SECONDS}s"
      ;;
    *) echo "== unknown part $1: skipped" ;;
  esac
}

session() {
  echo "== parts: $PARTS; TOTAL ${TOTAL}s; WORK $WORK"
  install
  build_models
  versions
  # every kind of job on a tiny model first (~30 s): an engine error on this device then costs seconds,
  # not every bench below (2026-11-27: each job of a 7-minute call failed at its first CUDA line)
  if [ "${PREFLIGHT:-1}" = 1 ]; then
    echo "== bench/gpu_preflight.py at ${SECONDS}s"
    if ! timeout -k 5 120 python3 bench/gpu_preflight.py --keep "$WORK/preflight"; then
      echo "== preflight failed at ${SECONDS}s: nothing else runs (fix it here, then call again)"
      for pid in "${BUILDS[@]}"; do kill "$pid" 2> /dev/null; done
      return 1
    fi
  fi
  wait_builds
  local p
  for p in $PARTS; do
    part "$p"
  done

  for d in "$WORK"/vs-*/*/ "$WORK"/check*/*/; do
    [ -f "$d/log.txt" ] && { echo "===== $d"; tail -n 40 "$d/log.txt"; }
  done > "$OUT/runs_tail.txt" 2>&1
  python3 - "$WORK" "$OUT/run_details.json" <<'EOF'
import json, pathlib, sys
work, details = pathlib.Path(sys.argv[1]), {}
for d in sorted(p for p in [*work.glob("vs-*/*"), *work.glob("check*/*")] if p.is_dir() and p.name != "models"):
    entry = {}
    if (d / "metrics.jsonl").exists():
        entry["metrics"] = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    for name in ("trl_result.json", "cuda_peaks.json", "unavailable.json"):
        if (d / name).exists():
            entry[name] = json.loads((d / name).read_text())
    if entry:
        details[f"{d.parent.name}/{d.name}"] = entry
pathlib.Path(sys.argv[2]).write_text(json.dumps(details))
EOF
  echo "== done at ${SECONDS}s"
}

session 2>&1 | tee "$OUT/log.txt"
