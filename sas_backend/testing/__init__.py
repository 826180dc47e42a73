"""Tooling for the tests, benchmarks and the soak, not the serving path: `server` launches real SGLang servers
(it needs `requests`, in the `test` and `bench` extras)."""
