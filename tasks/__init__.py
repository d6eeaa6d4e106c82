"""Stage logic of llmopt: pure functions, grouped as the pipeline runs them — inputs/, build/, engines/ (every
engine behind the Runtime contract), measure/, decide/, report/ — on top of config, errors and storage."""
