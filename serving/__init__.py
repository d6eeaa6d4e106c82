"""The inference server: resolves a registry alias and answers completion requests through the Runtime."""
