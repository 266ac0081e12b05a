#!/usr/bin/env bash
# The wheels a device call carries for bench/gpu_session.sh (the lent GPU machine's python 3.12 has torch
# 2.11+cu130 with its triton, transformers 5.17, peft and accelerate, but none of these; nothing can be
# fetched there), downloaded here into .whl/ (git-ignored through .git/info/exclude):
#
#     bash bench/gpu_wheels.sh        # then run(..., carry=[".whl"]); a call carries 64 MiB at most
#
# .whl/          pydantic and its parts, pydantic-settings, python-dotenv, trl 1.16.0, datasets, dill,
#                multiprocess, bitsandbytes, liger-kernel (pure Python + Triton kernels; TRL's
#                use_liger_kernel). bitsandbytes' wheel (43 MB) carries a native library for every CUDA and
#                ROCm release; it is repacked with the one the machine's torch loads (BNB_CUDA, default 130:
#                torch.version.cuda 13.0 on the H200s of 2026-11-26..28) and the CPU one: ~3.7 MB.
# .whl/unsloth/  Unsloth, for the "unsloth" rows of bench/gpu_vs_trl.py alone (gpu_session.sh installs it
#                apart, into UNSLOTH_SITE, first on those runs' PYTHONPATH): unsloth and unsloth_zoo
#                2026.10.9, and the pins they need that the rest must not see: trl 1.15.0 (Unsloth wants
#                <= 1.15), datasets 4.8.5 (Unsloth: < 5; TRL 1.15: >= 4.7) with the fsspec it allows
#                (<= 2026.2.0; the machine has 2026.7.0); and what they import that the machine may lack
#                (tyro and its parts, cut-cross-entropy, msgspec, einops, sentencepiece, pillow, requests and
#                its parts, protobuf, json5, nest-asyncio, structlog, torchao). unsloth's wheel (28.6 MB) is repacked
#                without studio/ (its web app: 26 MB; the library never imports it): ~2.3 MB. Not carried:
#                xformers (~100+ MB; Unsloth falls back to SDPA without it, we expect: the bench will say),
#                torchvision (must match the machine's CUDA build of torch; none on PyPI for cu130),
#                hf_transfer (downloads only). Whether Unsloth imports there is not known until a GPU session
#                tries: its row then reads "unavailable: <the exception>".
# .whl/decode/   transformers 5.24 and the huggingface-hub it needs (~14 MB), put first for
#                bench/rollouts_decode.py alone (the static KV cache needs 5.24: training.rollouts); DECODE=0
#                leaves them out (issue 45's session does not run that bench).
# Not available at all: flash-attn (PyPI has only its source; the machine can neither build it nor fetch
# a prebuilt one), hub kernels (kernels-community/*: the `kernels` package downloads them from the Hub at
# run time). bench/trl_reference.varlen_attention says so in each TRL row that wanted them.
#
# Sizes (2026-11-29, these versions): .whl/ ~8.6 MB, .whl/unsloth/ ~20 MB, .whl/decode/ ~14 MB: 42 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
BNB_CUDA=${BNB_CUDA:-130}
rm -rf .whl
mkdir -p .whl/unsloth
download() {  # DIR NAME==VERSION ...: cp312 manylinux x86_64 wheels, each without its dependencies
  local dir=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dir" "$@"
}
# repack WHEEL PYTHON_PREDICATE: rewrite the wheel without the members for which `drop(name)` is true,
# its RECORD without their lines (pip checks RECORD against the files it installs)
repack() {
  python3 - "$1" "$2" <<'EOF'
import os, sys, zipfile
path, predicate = sys.argv[1], sys.argv[2]
drop = eval("lambda name: " + predicate)  # noqa: S307  # our own predicate, below
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if drop(info.filename):
            continue
        data = src.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines()
            data = ("\n".join(l for l in lines if not drop(l.split(",")[0])) + "\n").encode()
        dst.writestr(info, data)
os.replace(tmp, path)
print(f"repacked {os.path.basename(path)}: {os.path.getsize(path) / 1e6:.1f} MB")
EOF
}
download .whl pydantic==2.12.5 pydantic_core==2.41.5 annotated-types typing-inspection pydantic-settings \
  python-dotenv trl==1.16.0 datasets dill multiprocess bitsandbytes==0.50.2 liger-kernel==0.8.5
repack .whl/bitsandbytes-*.whl \
  "name.startswith('bitsandbytes/libbitsandbytes_') and not name.endswith(('_cuda$BNB_CUDA.so', '_cpu.so'))"
download .whl/unsloth unsloth==2026.10.9 unsloth-zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 \
  fsspec==2026.2.0 tyro docstring-parser typeguard shtab cut-cross-entropy msgspec einops sentencepiece \
  pillow requests urllib3 idna charset-normalizer certifi protobuf json5 nest-asyncio structlog torchao
repack .whl/unsloth/unsloth-2026.10.9-*.whl "name.startswith('studio/')"
if [ "${DECODE:-1}" = 1 ]; then
  mkdir -p .whl/decode
  download .whl/decode transformers==5.24.0 huggingface-hub==1.31.0
fi
ls -l .whl .whl/*/
du -sh .whl .whl/*/
total=$(du -sb .whl | cut -f1)
echo "total $((total / 1024 / 1024)) MiB of the 64 MiB a call carries"
((total < 64 * 1024 * 1024 - 2 * 1024 * 1024)) || { echo "too big for one call"; exit 1; }
