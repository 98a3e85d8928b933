# modelcanary image: `docker build -t <registry>/modelcanary:<version> .`
# The Helm chart (helm/modelcanary) runs it as `modelcanary serve|collect|control --config ...`.

# ---- builder: wheels for modelcanary and every dependency ------------------------------------
FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY modelcanary ./modelcanary
COPY service ./service
COPY collectors ./collectors
COPY dashboards ./dashboards
RUN pip wheel --wheel-dir /wheels .

# ---- runtime: no compilers, no build tools, non-root ------------------------------------------
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 modelcanary \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/modelcanary --no-create-home \
    --shell /usr/sbin/nologin modelcanary \
 && mkdir -p /etc/modelcanary /var/lib/modelcanary \
 && chown 10001:10001 /var/lib/modelcanary
# Install from the builder's wheels only (no index, nothing compiled here); the wheels never
# become a layer of this image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels modelcanary \
 && modelcanary --help >/dev/null
WORKDIR /var/lib/modelcanary
USER 10001:10001
# proxy (serve), shadow workers' metrics (collect), controller's metrics (control)
EXPOSE 8080 9464 9465
ENTRYPOINT ["modelcanary"]
CMD ["serve", "--config", "/etc/modelcanary/modelcanary.yaml", "--host", "0.0.0.0", "--port", "8080"]
