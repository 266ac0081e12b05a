#!/usr/bin/env bash
# The wheels a device call carries for bench/gpu_session.sh (the lent GPU machine's python 3.12 has torch,
# transformers 5.17, peft and accelerate, but none of these; nothing can be fetched there), downloaded here
# into .whl/ (git-ignored through .git/info/exclude), ~62 MB of the 64 MiB a call carries:
#
#     bash bench/gpu_wheels.sh        # then run(..., carry=[".whl"])
#
# .whl/decode/: transformers 5.24 and the huggingface-hub it needs, put first for bench/rollouts_decode.py
# alone (the static KV cache needs 5.24: training.rollouts).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl/decode
download() {  # DIR NAME==VERSION ...: cp312 manylinux x86_64 wheels, each without its dependencies
  local dir=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dir" "$@"
}
download .whl pydantic==2.12.5 pydantic_core==2.41.5 annotated-types typing-inspection pydantic-settings \
  python-dotenv trl==1.16.0 datasets dill multiprocess bitsandbytes
download .whl/decode transformers==5.24.0 huggingface-hub==1.31.0
ls -l .whl .whl/decode
du -sh .whl
