"""What every epd process runs on: stopping, following its supervisor, a watchdog, GET /health."""
