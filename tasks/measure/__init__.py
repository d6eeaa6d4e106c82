"""Measuring: accuracy (perplexity, cloze, agreement, lm-eval) and speed through each variant's Runtime."""
