"""A soak of a real `sas` server (`python -m sas_backend.soak`): workload.py (the requests),
client.py (one request over HTTP), run.py (drive, then check every page and summary row came back)."""
