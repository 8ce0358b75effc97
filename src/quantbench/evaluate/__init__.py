"""Scoring checkpoints: quality against the base model, task evals, speed."""
