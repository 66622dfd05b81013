# One image for every KCaaS service: the control plane (gunicorn, the control queue's Celery worker, Celery beat),
# the one-shot bootstrap (scripts/up.py --bootstrap-only) and the node agent (python -m gpu_node.agent). Configured
# only through environment variables (docs/operations.md). torch's Linux wheel carries its CUDA libraries: the same
# image runs an agent on the CPU or, given a GPU (docker-compose.gpu.yml), on CUDA.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app/platform:/app:/app/kernels \
    DJANGO_SETTINGS_MODULE=controlplane.settings \
    KCAAS_VAR_DIR=/var/lib/kcaas

# a C compiler for gpu_node/engine/_blockhash.c (the prefix-hash loop; the agent falls back to hashlib without it); the RDMA
# and NUMA libraries the network extra's Mooncake binaries link even over TCP (scripts/store_libs.sh's list)
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libibverbs1 librdmacm1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY . /app
# Exactly locks/server.txt (the tested versions, without the test tools), the SDK editable on top, and the node's C
# extension built next to its source (scripts/server_env.py); the server rooms come from /app on PYTHONPATH.
RUN pip install --require-hashes -r locks/server.txt \
    && pip install --no-deps --no-build-isolation -e . \
    && python scripts/server_env.py \
    && useradd --system --uid 10001 --home-dir /var/lib/kcaas kcaas \
    && mkdir -p /var/lib/kcaas /var/lib/kcaas-nodes \
    && chown kcaas:kcaas /var/lib/kcaas /var/lib/kcaas-nodes \
    && chmod 0700 /var/lib/kcaas /var/lib/kcaas-nodes \
    && chmod 0755 /app/scripts/container-entrypoint.sh

USER kcaas
ENTRYPOINT ["/app/scripts/container-entrypoint.sh"]
CMD ["python", "-m", "gunicorn", "controlplane.wsgi:application", "--bind", "0.0.0.0:8000"]
