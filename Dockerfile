# The pipeline's image, which `make deploy`'s manifests run (docs/deploy.md). Not built on the development machines
# (no container runtime there): the manifests, the proxy and the routing are tested here, the image only in a cluster.
#   cpu overlay:  docker build -t <deploy.image> .
#   gpu overlay:  docker build -t <image-repo>-trtllm:<tag> --build-arg BASE_IMAGE=<Triton TensorRT-LLM image> \
#                   --build-arg PIP_ARGS="PyYAML==6.0.4 psutil==7.2.2 starlette==1.10.0 uvicorn==0.54.0" .
#                 (the container keeps its own torch, TensorRT-LLM and tritonserver; only the pipeline's light
#                 dependencies are added)
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG PIP_ARGS="-r requirements.txt"
# gcc: the C kernel compiles on first use; ssh: the LeaderWorkerSet's workers take mpirun's ranks over it.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev openssh-server openssh-client \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt ./
RUN python3 -m pip install --no-cache-dir ${PIP_ARGS}
COPY pipeline ./pipeline
COPY build ./build
COPY Makefile README.md ./
ENV PIPELINE_CACHE=/cache/spec-pipeline HF_HUB_OFFLINE=1
