# hsx, the client daemon (not the SGLang server): `docker build -t hsx .`
# Run: docker run --rm -v /etc/hsx:/etc/hsx:ro -v /dev/shm:/dev/shm -v /nvme:/nvme \
#        --network host hsx run --config /etc/hsx/config.toml
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The CPU build of torch first: hsx only reads and writes tensors, and with torch already
# satisfied `pip install .` does not pull the multi-GB CUDA build. Being first, this
# largest layer stays cached across code edits.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md ./
COPY hsx_async ./hsx_async
RUN pip install . \
    && rm -rf /src

# For the SGLang side of a Kubernetes pod: deploy/k8s/job.yaml copies this script and the
# hsx_async package (the dump hook) into the server's container.
COPY deploy/sglang/launch.sh /opt/hsx/sglang-launch.sh

# uid/gid 10001 match runAsUser/fsGroup in deploy/k8s/job.yaml.
RUN groupadd --system --gid 10001 hsx \
    && useradd --system --uid 10001 --gid hsx --create-home --shell /usr/sbin/nologin hsx
USER 10001:10001
WORKDIR /home/hsx

# /metrics and /status ([daemon].metrics_listen; bind 0.0.0.0 inside a container).
EXPOSE 9464
ENTRYPOINT ["hsx"]
CMD ["--help"]
