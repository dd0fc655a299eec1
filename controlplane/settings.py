"""Nightwatch settings: one file, everything from the environment.

With no variable set, everything runs embedded (SQLite in WAL mode, the in-memory channel layer,
a filesystem Celery broker under ``var/``): no server to install. ``DATABASE_URL`` switches to
PostgreSQL and ``REDIS_URL`` to Redis for Celery and Channels. ``NIGHTWATCH_ENV=production``
turns on the deployment hardening and refuses to start without a secret key or with DEBUG on
(system checks ``nightwatch.E001``/``E002`` in ``controlplane/checks.py``).
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from kombu import Queue

from alerts.beat import BEAT_SCHEDULE as ALERTS_BEAT_SCHEDULE
from checkpoints.beat import BEAT_SCHEDULE as CHECKPOINTS_BEAT_SCHEDULE
from core.env import env_bool, env_float, env_int, env_list, env_secret, env_str
from jobs.beat import AT_START as JOBS_BEAT_AT_START
from jobs.beat import BEAT_SCHEDULE as JOBS_BEAT_SCHEDULE
from nodes.beat import AT_START as NODES_BEAT_AT_START
from nodes.beat import BEAT_SCHEDULE as NODES_BEAT_SCHEDULE

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("NIGHTWATCH_VAR_DIR", str(BASE_DIR / "var")))

NIGHTWATCH_ENV = env_str("NIGHTWATCH_ENV", "development")
PRODUCTION = NIGHTWATCH_ENV == "production"
DEBUG = env_bool("DEBUG", default=not PRODUCTION)


def _development_secret_key() -> str:
    """A per-checkout random key kept under var/ so sessions survive restarts; never in the repo."""
    path = VAR_DIR / "secret_key"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        key = secrets.token_urlsafe(50)
        path.write_text(key)
        path.chmod(0o600)
        return key


# Production must be given one (nightwatch.E001 refuses to start without); development makes its own.
SECRET_KEY_PROVIDED = bool(env_secret("SECRET_KEY"))
# An unusable random stand-in lets Django boot far enough for the check to report the problem.
SECRET_KEY = env_secret("SECRET_KEY") or (secrets.token_urlsafe(50) if PRODUCTION else _development_secret_key())
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", [] if PRODUCTION else ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")
SITE_URL = env_str("SITE_URL", "http://127.0.0.1:8000")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "core",
    "controlplane",
    "jobs",
    "nodes",
    "checkpoints",
    "alerts",
    "dashboard",
    "axes",  # login lockouts (see "Login throttling" below)
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "core.middleware.RequestContextMiddleware",
    "core.middleware.ApiBoundaryMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "core.middleware.PageSecurityMiddleware",
    # Last, as django-axes requires: it turns a lockout flagged during authentication into the answer.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL")
DB_POOL_MAX_SIZE = env_int("DB_POOL_MAX_SIZE", 0)
if DATABASE_URL:
    # A pool (psycopg_pool, Django's "pool" option) keeps up to DB_POOL_MAX_SIZE connections per process
    # open across requests: opening one per request cost ~3.4 ms of a ~24 ms report (issue 18's probe).
    # Persistent connections (DB_CONN_MAX_AGE) are the alternative only under WSGI: under ASGI every
    # request runs in a thread of its own, whose connection is never reused.
    conn_max_age = 0 if DB_POOL_MAX_SIZE else env_int("DB_CONN_MAX_AGE", 0)
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=conn_max_age)}
    if DB_POOL_MAX_SIZE:
        if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
            raise ImproperlyConfigured("DB_POOL_MAX_SIZE: a connection pool needs PostgreSQL")
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 1,
            "max_size": DB_POOL_MAX_SIZE,
            # A request that waits longer than this for a free connection fails instead of queueing forever.
            "timeout": env_float("DB_POOL_TIMEOUT_S", 10.0),
        }
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "nightwatch.sqlite3",
            # WAL lets the web process read while the worker writes; IMMEDIATE transactions take
            # the write lock up front, so two writers queue instead of failing on lock upgrade.
            "OPTIONS": {
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
            },
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Broker, channel layer ------------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    # A Redis that is down must cost a publish a second, not a TCP timeout: the message then waits in
    # the outbox (core.outbox) and the request answers.
    CELERY_BROKER_TRANSPORT_OPTIONS: dict = {"socket_connect_timeout": 1}
    # redis-py 8 times a read out after 5 s by default, exactly channels-redis's BZPOPMIN wait: an idle
    # consumer's receive then fails with TimeoutError and its WebSocket dies. Give reads more room.
    CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer",
                    "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 15}]}}
    }
else:
    # kombu's filesystem transport: a directory both the web process and the worker can reach.
    # core.broker's version of it, whose messages appear whole (kombu's can be read half-written).
    from core import broker

    BROKER_DIR = VAR_DIR / "broker"
    for sub in ("queue", "processed", "control"):
        (BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = f"{broker.SCHEME}://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "store_processed": False,
        # Broadcast (worker control) messages; kombu's default is ./control in the working directory.
        "control_folder": str(BROKER_DIR / "control"),
    }
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
# Checkpoint-side work (verification hashes every shard, replication copies them, retention deletes
# them) takes seconds to minutes; queued in front of ``jobs.tasks.handle_exit`` it made a crash look
# like a hang (docs/benchmarks/chaos.md, finding 3). It has its own queue and its own worker
# (``celery worker -Q checkpoints``); failure handling keeps the default queue to itself.
# Judgement and upkeep whose delay of seconds costs nothing go to ``background``, for the same reason:
# at 1,024 nodes the straggler check of a 512-node job, the alerts sweep and the minute's telemetry
# roll-up took 2-6 s each, and a rank's exit report waited behind them (bench.fleet, issue 18).
BACKGROUND_TASKS = (
    "jobs.tasks.check_stragglers", "jobs.tasks.maintain_node_windows", "jobs.tasks.push_checkpoint_intervals",
    "jobs.tasks.prune_training_logs", "nodes.tasks.prepare_telemetry_partitions", "nodes.tasks.prune_telemetry",
    "nodes.tasks.roll_up_telemetry", "alerts.tasks.sweep",
)
# The sweeps that find what expired (heartbeats, progress deadlines, recoveries to drive) run every
# 0.25-2 s and expire a few periods after they were sent. On the default queue, behind a backlog of
# exits, acks and recoveries, they expired unrun: 27 times in one run at 1,024 nodes, 9 in a row after
# a worker restart, and a dead node was marked 46 s past its deadline (bench.fleet run S, issue 18).
# They have a queue of their own, which the default worker consumes as well: Redis hands a worker's
# queues out in turn, so a sweep waits for the tasks in progress, not a backlog. Both queues are the
# declared ones, so a worker started without ``-Q`` (compose's, the systemd unit's, one deployed
# before this queue existed) consumes both; ``-Q checkpoints`` and ``-Q background`` select theirs.
SWEEPS_QUEUE = "sweeps"
SWEEP_TASKS = ("jobs.tasks.expire_progress", "jobs.tasks.sweep", "nodes.tasks.expire_heartbeats")
CELERY_TASK_QUEUES = (Queue("celery", routing_key="celery"), Queue(SWEEPS_QUEUE, routing_key=SWEEPS_QUEUE))
CELERY_TASK_ROUTES = {"checkpoints.tasks.*": {"queue": "checkpoints"},
                      **{name: {"queue": "background"} for name in BACKGROUND_TASKS},
                      **{name: {"queue": SWEEPS_QUEUE} for name in SWEEP_TASKS}}
# Keep LOGGING below (JSON lines with job/node ids) in the worker too, instead of Celery's own format.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# The cache holds rate-limit counters: in Redis when there is one, so that every web process
# counts together; otherwise per process. With Redis down it counts per process (core.cache), and a
# request waits at most one short timeout for it.
if REDIS_URL:
    CACHES = {"default": {"BACKEND": "core.cache.ResilientRedisCache", "LOCATION": REDIS_URL,
                          "KEY_PREFIX": "nightwatch",
                          "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5}}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
# Periodic one-shots. The sweeper finds hung generations and finishes recoveries a dead worker
# left half-done; its period bounds how late a hang is noticed after its progress deadline.
SWEEP_INTERVAL_S = env_float("NIGHTWATCH_SWEEP_INTERVAL_S", 2.0)
# The hang check alone, more often: a 0.1 s-step job is due a verdict 5 s after its last step
# (jobs.progress), and each deadline falls one of these early so that the verdict is in time. Cheap:
# one indexed query on the progress deadline (and the silence/overload holds) when nothing is due.
PROGRESS_SWEEP_INTERVAL_S = env_float("NIGHTWATCH_PROGRESS_SWEEP_INTERVAL_S", 0.25)
CELERY_BEAT_SCHEDULE: dict = {
    "jobs-sweep": {"task": "jobs.tasks.sweep", "schedule": SWEEP_INTERVAL_S, "options": {"expires": 30}},
    "jobs-progress": {"task": "jobs.tasks.expire_progress", "schedule": PROGRESS_SWEEP_INTERVAL_S,
                      "options": {"expires": 5}},
    **JOBS_BEAT_SCHEDULE,
    **NODES_BEAT_SCHEDULE,
    **CHECKPOINTS_BEAT_SCHEDULE,
    **ALERTS_BEAT_SCHEDULE,
    # Celery messages held while the broker was down (core.outbox): sent once it answers again.
    "core-outbox": {"task": "core.tasks.send_outbox", "schedule": env_float("NIGHTWATCH_OUTBOX_INTERVAL_S", 5.0),
                    "options": {"expires": 30}},
}
# Beat's first run of an interval task comes an interval after beat starts. These run at its start
# as well (controlplane.celery.run_at_beat_start): they make room ahead (time partitions), and an
# hour without them sends a fresh deployment's telemetry into the default partitions.
BEAT_AT_START: tuple[str, ...] = (*JOBS_BEAT_AT_START, *NODES_BEAT_AT_START)

# --- Auth, API ------------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# --- Login throttling (django-axes) -----------------------------------------------------------
# Both login forms (/login/ and /admin/login/) authenticate through Django's authenticate(), which
# the axes backend guards; API tokens never do, so axes cannot touch token authentication. A user
# name, or an address, with AXES_FAILURE_LIMIT failed logins within the cool-off is refused (429, a
# page saying until when) until the cool-off has passed since its last failure. The address is
# core.auth.client_address, the same as every other per-address limit.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("NIGHTWATCH_LOGIN_FAILURE_LIMIT", 10)
AXES_COOLOFF_TIME = timedelta(minutes=env_float("NIGHTWATCH_LOGIN_COOLOFF_MIN", 15))
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_CLIENT_IP_CALLABLE = "core.auth.client_address"
AXES_LOCKOUT_TEMPLATE = "dashboard/locked_out.html"
# Hammering a locked account must not keep it locked for ever: the cool-off runs from the failure
# that locked it, not from the latest refused try.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
# Successful logins are in the web logs already; axes keeps only the failures (AccessAttempt).
AXES_DISABLE_ACCESS_LOG = True
# --- end of login throttling --------------------------------------------------------------------

LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "core.auth.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["core.auth.Requires"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["core.api.JSONParser"],
    "DEFAULT_PAGINATION_CLASS": "core.api.Pagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "core.problems.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "core.schema.AutoSchema",
    # Per node token on the agent endpoints, per address on registration (core.auth).
    "DEFAULT_THROTTLE_RATES": {
        "agent": env_str("NIGHTWATCH_AGENT_RATE", "1200/min"),
        "register": env_str("NIGHTWATCH_REGISTER_RATE", "60/min"),
    },
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Nightwatch API",
    "DESCRIPTION": "Control plane for fault-tolerant PyTorch training: jobs, nodes, checkpoints.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {"CheckpointStateEnum": "checkpoints.choices.CheckpointState",
                            "IncidentKindEnum": "jobs.choices.IncidentKind",
                            "IncidentStateEnum": "jobs.choices.IncidentState",
                            "AlertSeverityEnum": "alerts.choices.Severity",
                            "DeliveryStateEnum": "alerts.choices.DeliveryState"},
}

# --- Static files, i18n ---------------------------------------------------------------------
STATIC_URL = "/static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "staticfiles")))
if not PRODUCTION:
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # whitenoise warns about a missing root
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []
# The dashboard's chart library, installed by `npm ci` from dashboard/frontend/package-lock.json.
UPLOT_DIST = BASE_DIR / "dashboard" / "frontend" / "node_modules" / "uplot" / "dist"
if UPLOT_DIST.is_dir():
    STATICFILES_DIRS.append(("vendor/uplot", UPLOT_DIST))
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if PRODUCTION
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
WHITENOISE_USE_FINDERS = not PRODUCTION
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Security -------------------------------------------------------------------------------
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
# Sent with every API and /metrics response (core.middleware): they are data, never pages.
NIGHTWATCH_API_CSP = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
# --- Page CSP -----------------------------------------------------------------------------------
# Sent with every HTML page outside /api/ (dashboard, login, admin; core.middleware): scripts,
# styles, images only from this origin, no inline script or style. The live view's WebSocket to this
# host (ws:// or wss://) is added per request, since 'self' does not cover it in every browser.
NIGHTWATCH_PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                       "object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'")
# --- end of page CSP ----------------------------------------------------------------------------
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DATA_UPLOAD_MAX_MEMORY_SIZE", 4 * 1024 * 1024)
if PRODUCTION:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    # Probes and scrapes come over plain HTTP from inside the cluster.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True

SILENCED_SYSTEM_CHECKS = env_list("SILENCED_SYSTEM_CHECKS")

# --- Logging --------------------------------------------------------------------------------
# JSON lines (core.logs) carrying job, generation, node and incident ids; LOG_FORMAT=plain for people.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
                   "json": {"()": "core.logs.ControlPlaneJsonFormatter", "service": "control-plane"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": env_str("LOG_FORMAT", "json")}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"},
                # django-axes logs every failed login at INFO; failures and lockouts are WARNING.
                "axes": {"level": "WARNING"}},
}

# --- Email (alert channels send through Django's mail backend) -----------------------------
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend" if env_str("EMAIL_HOST")
                        else "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER")
EMAIL_HOST_PASSWORD = env_secret("EMAIL_HOST_PASSWORD")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "nightwatch@localhost")

# --- Nightwatch -----------------------------------------------------------------------------
NIGHTWATCH = {
    # Seconds between agent heartbeats, and how many may be missed before "unreachable".
    "HEARTBEAT_INTERVAL_S": env_int("NIGHTWATCH_HEARTBEAT_INTERVAL_S", 5),
    "HEARTBEAT_MISSES": env_int("NIGHTWATCH_HEARTBEAT_MISSES", 3),
    # Heartbeat pacing (nodes/services/fleet.py, as Nomad's max_heartbeats_per_second): the interval
    # agents are asked for stretches so that the fleet sends at most this many heartbeats a second
    # (0: never stretched), up to HEARTBEAT_INTERVAL_MAX_S. 50 a second is 250 nodes at 5 s, 1,088
    # at 21.8 s; a node's timeout stays HEARTBEAT_MISSES of the interval it was asked for.
    "MAX_HEARTBEATS_PER_S": env_float("NIGHTWATCH_MAX_HEARTBEATS_PER_S", 50.0),
    "HEARTBEAT_INTERVAL_MAX_S": env_float("NIGHTWATCH_HEARTBEAT_INTERVAL_MAX_S", 30.0),
    # How long a bootstrap token may wait for its agent's (single) registration.
    "BOOTSTRAP_TOKEN_TTL_S": env_int("NIGHTWATCH_BOOTSTRAP_TOKEN_TTL_S", 24 * 3600),
    # Admission control (core/admission.py): HTTP requests one web process works on at once (0: no
    # bound), how many of those only heartbeats, registrations and agent events may use, and the
    # Retry-After of a 503. Django runs a process's views one at a time (its ASGI handler's
    # thread-sensitive executor), so the bound sets how long the queue is, not how much is served:
    # 16 at 20-60 ms a request keeps the last in line under a second. At 64 the fleet benchmark's
    # 1,024 nodes had heartbeats wait 5 s and more, which holds every verdict (nodes/services/overload.py).
    "MAX_IN_FLIGHT": env_int("NIGHTWATCH_MAX_IN_FLIGHT", 16),
    "PRIORITY_RESERVE": env_int("NIGHTWATCH_PRIORITY_RESERVE", 4),
    # Of those, the slots heartbeats and registrations leave free for the agents' events (exits, Xids).
    "URGENT_RESERVE": env_int("NIGHTWATCH_URGENT_RESERVE", 2),
    "RETRY_AFTER_S": env_int("NIGHTWATCH_RETRY_AFTER_S", 1),
    # A refused bulk request is asked to wait RETRY_AFTER_S x offered / admitted bulk, at most this
    # (core.admission.Pressure); the hang sweep spares a refused job 1.5 x this (jobs.progress).
    "RETRY_AFTER_MAX_S": env_int("NIGHTWATCH_RETRY_AFTER_MAX_S", 10),
    # The order admitted requests are served in (core.admission.Gate): this many go into Django at
    # once (0: all, in arrival order), the rest wait their turn, agent events and command acks first,
    # then heartbeats and operators' actions, ADMISSION_SHARE of them for each bulk request while both wait.
    # Off until bench.fleet has measured it at 1,024 nodes (2 is the width to try: Django's one thread
    # plus the next request's body being read).
    "ADMISSION_WIDTH": env_int("NIGHTWATCH_ADMISSION_WIDTH", 0),
    "ADMISSION_SHARE": env_int("NIGHTWATCH_ADMISSION_SHARE", 3),
    # GPU telemetry (docs/architecture.md, "Telemetry storage"): raw samples for this many hours
    # (dropped an hourly partition at a time on PostgreSQL), 1-minute rollups for this many days.
    "TELEMETRY_RAW_RETENTION_HOURS": env_int("NIGHTWATCH_TELEMETRY_RAW_RETENTION_HOURS", 48),
    "TELEMETRY_ROLLUP_RETENTION_DAYS": env_int("NIGHTWATCH_TELEMETRY_ROLLUP_RETENTION_DAYS", 90),
    # Rank timings per node and window (jobs.models.NodeWindow); the job's step rows are kept.
    "NODE_WINDOW_RETENTION_HOURS": env_int("NIGHTWATCH_NODE_WINDOW_RETENTION_HOURS", 48),
    # Stragglers (docs/detection.md): a rank's extra time over the job's median step that counts
    # (0: agents.detectors.DetectionPolicy's default, 1.025). Raise it where step times are noisy.
    "STRAGGLER_RATIO": env_float("NIGHTWATCH_STRAGGLER_RATIO", 0.0),
    # How long an Idempotency-Key is remembered.
    "IDEMPOTENCY_TTL_S": env_int("NIGHTWATCH_IDEMPOTENCY_TTL_S", 24 * 3600),
    # The URL nodes and train.py use to reach the control plane.
    "PUBLIC_URL": env_str("NIGHTWATCH_PUBLIC_URL", SITE_URL),
    # Where checkpoints go when a job's policy names no directory (must be shared with the nodes).
    "CHECKPOINT_ROOT": env_str("NIGHTWATCH_CHECKPOINT_ROOT", str(VAR_DIR / "checkpoints")),
    # A second storage location; verified checkpoints are copied there and restores fall back to it.
    "CHECKPOINT_REPLICA_ROOT": env_str("NIGHTWATCH_CHECKPOINT_REPLICA_ROOT") or None,
    # Checkpoint files are hostile input (docs/checkpoints.md, "Verification"): the control plane
    # verifies from the manifest and sha256s, within these budgets, and never loads a tensor.
    # Replicas are written, read and deleted only inside REPLICA_ROOTS (comma-separated) and
    # CHECKPOINT_REPLICA_ROOT; a job's replica_dir outside them is refused.
    "CHECKPOINT_VERIFY_TIMEOUT_S": env_int("NIGHTWATCH_CHECKPOINT_VERIFY_TIMEOUT_S", 1800),
    "CHECKPOINT_VERIFY_MAX_BYTES": env_int("NIGHTWATCH_CHECKPOINT_VERIFY_MAX_BYTES", 4 << 40),
    "CHECKPOINT_MANIFEST_MAX_BYTES": env_int("NIGHTWATCH_CHECKPOINT_MANIFEST_MAX_BYTES", 16 << 20),
    "REPLICA_ROOTS": env_list("NIGHTWATCH_REPLICA_ROOTS"),
    # Before a job has failure history, MTBF = this per-GPU figure / the job's GPU count (an assumption).
    "GPU_MTBF_HOURS": env_int("NIGHTWATCH_GPU_MTBF_HOURS", 50_000),
    "MTBF_WINDOW_DAYS": env_int("NIGHTWATCH_MTBF_WINDOW_DAYS", 30),
    # Bandwidth a node pair must reach (at least 80% of it) in the pre-launch probe, MB/s. Set it
    # to your fabric's figure; the default only flags grossly broken links.
    "EXPECTED_PEER_MBPS": env_int("NIGHTWATCH_EXPECTED_PEER_MBPS", 100),
    # How long stopping a generation may take before the job is paused and escalated.
    "QUIESCE_TIMEOUT_S": env_int("NIGHTWATCH_QUIESCE_TIMEOUT_S", 60),
    # A node declared unreachable whose agent answers again within this many seconds, confirming
    # that nothing of the generation runs there, had a crash, not a partition (jobs/orchestrator.py).
    "AGENT_RETURN_WINDOW_S": env_int("NIGHTWATCH_AGENT_RETURN_WINDOW_S", 60),
    # Training output shipped by the agents (jobs.logs): characters kept per generation and node, days kept.
    "LOG_MAX_BYTES": env_int("NIGHTWATCH_LOG_MAX_BYTES", 2**20),
    "LOG_RETENTION_DAYS": env_int("NIGHTWATCH_LOG_RETENTION_DAYS", 7),
    # A new generation must report its first step within this long, or it counts as hung: the default
    # before the job has history; with history, 3 × its slowest start, but never below the floor.
    "STARTUP_TIMEOUT_S": env_int("NIGHTWATCH_STARTUP_TIMEOUT_S", 180),
    "STARTUP_TIMEOUT_FLOOR_S": env_int("NIGHTWATCH_STARTUP_TIMEOUT_FLOOR_S", 60),
    # This many nodes lost within the window is a suspected partition: PARTITION_NODES, or
    # PARTITION_FRACTION of the nodes that heartbeat when that is more (jobs.orchestrator.partition_threshold).
    "PARTITION_NODES": env_int("NIGHTWATCH_PARTITION_NODES", 2),
    "PARTITION_FRACTION": env_float("NIGHTWATCH_PARTITION_FRACTION", 0.01),
    "PARTITION_WINDOW_S": env_int("NIGHTWATCH_PARTITION_WINDOW_S", 120),
    # When at least this share of the nodes that heartbeat (and at least MIN_NODES of them) miss
    # their deadline together, the control plane suspects its own ingress, not the nodes: it holds
    # (no node turns unreachable, no job is declared hung) for up to HOLD_S, then gives up and
    # treats them as a partition. Like Kubernetes' node controller in full disruption.
    "FLEET_SILENCE_FRACTION": env_float("NIGHTWATCH_FLEET_SILENCE_FRACTION", 0.55),
    "FLEET_SILENCE_MIN_NODES": env_int("NIGHTWATCH_FLEET_SILENCE_MIN_NODES", 2),
    "FLEET_SILENCE_HOLD_S": env_int("NIGHTWATCH_FLEET_SILENCE_HOLD_S", 120),
    # Overload (nodes/services/overload.py): within the last heartbeat timeout, every web process
    # together refused at least HEARTBEAT_REFUSALS heartbeats (or registrations) or REFUSALS requests
    # of any kind (an event and a metric; whoever was refused is spared one by one, nobody is held),
    # or answered LATE_HEARTBEATS heartbeats HEARTBEAT_LAG_S (0: one heartbeat interval) or more after
    # they arrived, or QUEUE_DEPTH Celery messages wait (0, the default: off). The last two hold the
    # sweepers (no node unreachable, no job hung) for up to HOLD_S (0: no hold).
    "OVERLOAD_HEARTBEAT_REFUSALS": env_int("NIGHTWATCH_OVERLOAD_HEARTBEAT_REFUSALS", 1),
    "OVERLOAD_REFUSALS": env_int("NIGHTWATCH_OVERLOAD_REFUSALS", 100),
    "OVERLOAD_HEARTBEAT_LAG_S": env_float("NIGHTWATCH_OVERLOAD_HEARTBEAT_LAG_S", 0.0),
    "OVERLOAD_LATE_HEARTBEATS": env_int("NIGHTWATCH_OVERLOAD_LATE_HEARTBEATS", 10),
    "OVERLOAD_QUEUE_DEPTH": env_int("NIGHTWATCH_OVERLOAD_QUEUE_DEPTH", 0),
    "OVERLOAD_HOLD_S": env_int("NIGHTWATCH_OVERLOAD_HOLD_S", 300),
    # Lemon nodes (nodes/policies.py, LemonPolicy, where the defaults are): blamed LEMON_INCIDENTS
    # times, a node is kept out of placement until cleared (that many hardware incidents within
    # LEMON_WINDOW_S also drain it); crashes of LEMON_CRASH_JOBS different jobs on one node within
    # LEMON_CRASH_WINDOW_S blame it and drain it as suspect (defaults: the policy's, a test keeps them equal).
    "LEMON_INCIDENTS": env_int("NIGHTWATCH_LEMON_INCIDENTS", 3),
    "LEMON_WINDOW_S": env_int("NIGHTWATCH_LEMON_WINDOW_S", 7 * 24 * 3600),
    "LEMON_CRASH_JOBS": env_int("NIGHTWATCH_LEMON_CRASH_JOBS", 3),
    "LEMON_CRASH_WINDOW_S": env_int("NIGHTWATCH_LEMON_CRASH_WINDOW_S", 24 * 3600),
    # Paging (alerts app, docs/alerting.md): follow-ups of one alert at most once per interval;
    # notifications (never pages) capped per channel and hour; delivery retries with backoff.
    "ALERTS": {
        "UPDATE_INTERVAL_S": env_int("NIGHTWATCH_ALERTS_UPDATE_INTERVAL_S", 300),
        "CHANNEL_MAX_PER_HOUR": env_int("NIGHTWATCH_ALERTS_CHANNEL_MAX_PER_HOUR", 60),
        "MAX_ATTEMPTS": env_int("NIGHTWATCH_ALERTS_MAX_ATTEMPTS", 6),
        "RETRY_BASE_S": env_int("NIGHTWATCH_ALERTS_RETRY_BASE_S", 10),
        "RETRY_MAX_S": env_int("NIGHTWATCH_ALERTS_RETRY_MAX_S", 600),
        "REDISPATCH_GRACE_S": env_int("NIGHTWATCH_ALERTS_REDISPATCH_GRACE_S", 60),
        # Plain-http webhook URLs (fine on a private network, and for the tests' loopback receiver).
        "ALLOW_HTTP": env_bool("NIGHTWATCH_ALERTS_ALLOW_HTTP", not PRODUCTION),
        # Channels may reach only public addresses, and these networks (CIDRs) or host names.
        "ALLOWED_NETWORKS": env_list("NIGHTWATCH_ALERT_ALLOWED_NETWORKS"),
        # Fernet key encrypting webhook secrets and PagerDuty routing keys at rest; empty = derived
        # from SECRET_KEY (warned about in production: nightwatch.alerts.W001).
        "SECRETS_KEY": env_secret("NIGHTWATCH_SECRETS_KEY"),
    },
    # Efficiency watch (alerts.efficiency): MFU margin, utilisation floor, downtime ceiling, prices.
    "EFFICIENCY": {
        "MFU_MARGIN": env_float("NIGHTWATCH_MFU_MARGIN", 0.2),
        "CPU_PEAK_TFLOPS": env_float("NIGHTWATCH_CPU_PEAK_TFLOPS", 0.1),
        "GPU_UTILIZATION_MIN_PCT": env_float("NIGHTWATCH_GPU_UTILIZATION_MIN_PCT", 50),
        "UTILIZATION_WINDOW_S": env_int("NIGHTWATCH_UTILIZATION_WINDOW_S", 300),
        "DOWNTIME_RATIO_MAX": env_float("NIGHTWATCH_DOWNTIME_RATIO_MAX", 0.05),
        "DOWNTIME_MIN_WALL_S": env_int("NIGHTWATCH_DOWNTIME_MIN_WALL_S", 600),
        "DEFAULT_PRICE_PER_GPU_HOUR": env_float("NIGHTWATCH_PRICE_PER_GPU_HOUR", 2.0),
        "POOL_PRICES": {},  # pool -> price per GPU-hour; PoolPrice rows (admin, API) take precedence
        "CURRENCY": env_str("NIGHTWATCH_CURRENCY", "USD"),
    },
    # Slurm transport (docs/slurm.md): off unless enabled; then Slurm nodes are mirrored and
    # jobs placed on them run as batch jobs.
    "SLURM": {
        "ENABLED": env_bool("NIGHTWATCH_SLURM_ENABLED", False),
        "CLUSTER": env_str("NIGHTWATCH_SLURM_CLUSTER", "default"),
        "PARTITION": env_str("NIGHTWATCH_SLURM_PARTITION") or None,
        # Directory of the Slurm client commands; empty = found on PATH.
        "BIN_DIR": env_str("NIGHTWATCH_SLURM_BIN_DIR"),
        # Seconds one Slurm command may take before it counts as "Slurm is down".
        "COMMAND_TIMEOUT_S": env_int("NIGHTWATCH_SLURM_COMMAND_TIMEOUT_S", 30),
        # The longest back-off between tries while the controller does not answer.
        "MAX_BACKOFF_S": env_int("NIGHTWATCH_SLURM_MAX_BACKOFF_S", 300),
        # The interpreter with torch on the compute nodes, and the directory entrypoints resolve in.
        "PYTHON": env_str("NIGHTWATCH_SLURM_PYTHON") or None,
        "WORKDIR": env_str("NIGHTWATCH_SLURM_WORKDIR") or None,
        # Batch output, read back for exit evidence (a directory shared with the nodes).
        "LOG_DIR": env_str("NIGHTWATCH_SLURM_LOG_DIR", str(VAR_DIR / "slurm")),
        # Extra sbatch options, e.g. "--account=ml,--qos=high".
        "SBATCH_ARGS": env_list("NIGHTWATCH_SLURM_SBATCH_ARGS"),
    },
    # Failed token authentications one address may make per minute before it is answered 429.
    "AUTH_FAILURES_PER_MINUTE": env_int("NIGHTWATCH_AUTH_FAILURES_PER_MINUTE", 30),
    # /metrics: a token with the view capability, or a scraper from one of these networks (CIDRs).
    "METRICS_NETWORKS": env_list("NIGHTWATCH_METRICS_NETWORKS"),
    # Proxies (CIDRs) whose X-Forwarded-For is believed: the TLS proxy in front of daphne. With none,
    # the client is the direct peer and the header is ignored (core.auth.client_address).
    "TRUSTED_PROXIES": env_list("NIGHTWATCH_TRUSTED_PROXIES"),
}
