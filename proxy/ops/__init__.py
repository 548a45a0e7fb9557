"""The operator's side: doctor, metrics, structured logs and the status page."""
