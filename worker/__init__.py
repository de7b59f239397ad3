"""The worker runtime: engines, model loading, the Celery task and its signals."""
