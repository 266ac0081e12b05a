# Bring your own CUDA torch: the base image provides it; the project's torch range keeps it.
# One image for every service: the API, the workers (training runs as `python -m training.run`) and the
# inference engine (`ftune inference`: the inference package, with fastapi, transformers and peft).
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e .
ENV FTUNE_DATA_DIR=/data FTUNE_MODELS_DIR=/models
# the API, the inference engine
EXPOSE 8000 8001
