"""The DCS Celery worker fleet: one `dcs worker` per host persists checkpoints and bootstraps groups."""
