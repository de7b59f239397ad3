"""The Celery app as a module attribute, for Celery's command line: Flower
(`celery -A tasks.flower_app flower`) and `celery -A tasks.flower_app inspect|events` need an
app object, and `make_celery` is a factory. Flower sees tasks only while the workers send task
events (`GENQ_CELERY_EVENTS=1`, off by default: they cost time on every job)."""

from tasks.celery_app import make_celery

app = make_celery()
