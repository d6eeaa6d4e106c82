"""Stage logic of llmopt: pure functions, one module per pipeline stage."""
