# One image for every control-plane role: the API (with its scheduler), the migration job and the host
# workers (which start `locojax host` engine processes). Build: docker compose build
# The dashboard's browser libraries, exact versions from package.json (not committed, see .npmrc).
FROM node:20-slim AS assets
WORKDIR /assets
COPY package.json .npmrc ./
RUN npm install --no-save --no-audit --no-fund && mkdir vendor \
    && cp node_modules/htmx.org/dist/htmx.min.js node_modules/uplot/dist/uPlot.iife.min.js \
          node_modules/uplot/dist/uPlot.min.css vendor/

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /srv/locojax

# A C compiler builds locojax/_bind_shim.c, which binds a DA run's Ray to its host's address.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# Dependencies first (exact pins), so code changes do not reinstall them.
COPY pyproject.toml constraints.txt README.md ./
COPY locojax/__init__.py locojax/_bind_shim.c locojax/
COPY server/__init__.py server/__init__.py
COPY worker/__init__.py worker/__init__.py
COPY web/__init__.py web/__init__.py
RUN pip install -c constraints.txt .

COPY locojax locojax
COPY server server
COPY worker worker
COPY web web
COPY migrations migrations
COPY --from=assets /assets/vendor web/static/vendor
COPY alembic.ini ./
RUN pip install --no-deps -c constraints.txt . \
    && useradd --create-home --uid 1000 locojax && mkdir -p /srv/runs && chown locojax /srv/runs
USER locojax

EXPOSE 8000
CMD ["locojax", "serve", "--host", "0.0.0.0", "--port", "8000"]
