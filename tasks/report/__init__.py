"""Reporting: MLflow runs, leaderboard files and plots."""
