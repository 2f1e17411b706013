"""What runs beside the model: devices and backends, rank agreement, the exchange group, per-model state and records."""
