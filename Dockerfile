# GPU image: NVIDIA's NGC PyTorch container already carries CUDA, NCCL, Transformer Engine and
# apex, which megatron-hydra uses when present. Build: docker build -t megatron-hydra .
# Run:   docker run --gpus all --ipc=host -it megatron-hydra      (the default command: gpt_tiny)
#        docker run --gpus all --ipc=host -it megatron-hydra python launch.py model=gpt_1.3b parallel=tp2
# launch.py's defaults (trainer=auto, precision=auto) take one rank per visible GPU, bf16 weights with
# fp32 main weights, TF32 matmuls, pinned-memory loaders, and the global batch micro-batch x dp x pp.
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /workspace/megatron-hydra
COPY pyproject.toml README.md ./
COPY megatron_hydra ./megatron_hydra
COPY conf ./conf
COPY launch.py ./
COPY tests ./tests
COPY benchmarks ./benchmarks
COPY scripts ./scripts

# Keep the image's own torch build (its pre-release version string would not satisfy a plain
# requirement), then add the pure-Python dependencies.
RUN pip install --no-cache-dir --no-deps -e . \
 && pip install --no-cache-dir "pytorch-lightning>=2.4" "hydra-core>=1.3.2" "omegaconf>=2.3" tensorboard pytest pytest-timeout

ENV PYTHONUNBUFFERED=1
CMD ["python", "launch.py"]
