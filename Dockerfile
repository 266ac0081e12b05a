# Bring your own CUDA torch: the base image provides it; the project's torch range keeps it.
# One image for every service: the API, the workers (training runs as `python -m training.run`) and the
# inference engine (`ftune inference`: the inference package, with fastapi, transformers and peft).
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e .
ENV FTUNE_DATA_DIR=/data FTUNE_MODELS_DIR=/models
# What ftune writes (the database's secrets, datasets, adapters) is for its user alone, whatever command a
# container runs: umask 077 for every process, the data directory 0700 (a new named volume takes the
# image's mode; the entrypoint sets it on one made before, unless it is mounted read-only).
RUN mkdir -p /data && chmod 700 /data
ENTRYPOINT ["/bin/sh", "-c", "umask 077; if [ -w \"$FTUNE_DATA_DIR\" ]; then chmod 700 \"$FTUNE_DATA_DIR\"; fi; exec \"$@\"", "ftune-entrypoint"]
# the API, the inference engine
EXPOSE 8000 8001
