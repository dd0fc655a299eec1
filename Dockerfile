# The control-plane image: web (ASGI), worker and beat run from it with different commands.

# The dashboard's browser libraries, from the lockfile (served by whitenoise, never from a CDN).
FROM node:20-slim AS frontend
WORKDIR /frontend
COPY dashboard/frontend/package.json dashboard/frontend/package-lock.json ./
RUN npm ci --omit=dev

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DJANGO_SETTINGS_MODULE=controlplane.settings NIGHTWATCH_ENV=production
WORKDIR /app

RUN apt-get update && apt-get install -y --no-install-recommends curl openssh-client \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 nightwatch \
    && install -d -o nightwatch -g nightwatch /checkpoints

COPY pyproject.toml README.md ./
COPY agents agents
COPY controlplane controlplane
COPY jobs jobs
COPY nodes nodes
COPY checkpoints checkpoints
COPY alerts alerts
COPY dashboard dashboard
COPY --from=frontend /frontend/node_modules dashboard/frontend/node_modules
COPY templates templates
COPY manage.py ./
# The CPU build of torch is enough for the control plane (it never loads a checkpoint a node wrote:
# it verifies manifests and hashes, see docs/security.md).
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu '.[server]' \
    && SECRET_KEY=build-only-not-used ALLOWED_HOSTS=build python manage.py collectstatic --noinput

# Every service of the image runs as this unprivileged user (docs/security.md, "Processes").
USER nightwatch
EXPOSE 8000
# Refuses to start when production settings are unsafe (nightwatch.E001-E004). No --proxy-headers:
# daphne would believe X-Forwarded-For from any peer; controlplane.auth.client_address believes it
# only from NIGHTWATCH_TRUSTED_PROXIES.
CMD ["sh", "-c", "python manage.py check --deploy --fail-level ERROR && python manage.py migrate --noinput && exec daphne -b 0.0.0.0 -p 8000 controlplane.asgi:application"]
