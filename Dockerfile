# Cluster image: the project with the CUDA build of torch and vLLM (the `gpu` extra), for GPU nodes.
#   docker build -t replay-rloo:latest .            (or: make docker)
#   docker run --gpus all -v $PWD/work:/work -w /work replay-rloo:latest \
#       replay-rloo policy=qwen-sft-countdown hardware=h100 tracking.uri=http://<server>:5000
# Apptainer (most SLURM sites): build the .sif from this image, run with --nv (docs/slurm.md, "Containers").
# torch comes from PyPI here, i.e. its CUDA build: the wheels carry the CUDA libraries, so the node
# needs only an NVIDIA driver, no CUDA toolkit. The CPU lock (constraints-cpu.txt) is not used:
# vLLM 0.32.0 pins its own torch and transformers, which decide the versions in this image.
FROM python:3.11-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_DISABLE_PROGRESS_BARS=1 \
    TOKENIZERS_PARALLELISM=false \
    HYDRA_FULL_ERROR=0

# A C compiler for triton's and vLLM's just-in-time kernels; git for Hugging Face hub revisions.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential git \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/replay-rloo
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
COPY hydra_plugins ./hydra_plugins
COPY analysis ./analysis
COPY benchmarks ./benchmarks
COPY conf ./conf
COPY checkpoints ./checkpoints
# Editable, so the project root (conf/, checkpoints/, the ${root:} of the config) is /opt/replay-rloo.
RUN pip install "torch==2.13.0" && pip install -e ".[gpu]"

# Runs write outputs/ under the working directory: mount a writable one. The default MLflow store
# (${root:}/mlruns.db) is inside the image, read-only under Apptainer: on a cluster set
# tracking.uri=http://<server>:5000 (`make mlflow-server`) or tracking.uri=sqlite:////work/mlruns.db.
WORKDIR /work
CMD ["replay-rloo", "--help"]
