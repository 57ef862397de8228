"""What the router measures: Prometheus metrics, recent step records for /stats, the arrival mix."""
