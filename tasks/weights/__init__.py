"""Weights formats: how a torch variant's weights are stored and loaded back, one module per format
(tasks/weights/registry.py is the contract, tasks/weights/catalog.py the list). Techniques save with them, the
torch engine loads with them."""
