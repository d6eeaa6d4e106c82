"""Deciding: paired statistics, the leaderboard and its winner, registration and promotion."""
