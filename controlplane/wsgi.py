import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = get_wsgi_application()

from controlplane.checks import refuse_unsafe_production  # noqa: E402

refuse_unsafe_production()
