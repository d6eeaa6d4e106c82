"""Prefect wiring and the `llmopt` command line; stage logic lives in `tasks/`."""
