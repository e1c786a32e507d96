"""Real-process fixtures' machinery: redis-server, dcs worker, coordinator (uvicorn)."""
