"""Evaluation: compare a run against a reference run, row by row (metrics.py), and the step
program `python -m components.evaluate` that writes the metrics tables (run.py)."""

from components.evaluate.gates import Thresholds, summarize
from components.evaluate.metrics import compare_images, compare_runs, first_divergence, text_similarity

__all__ = ["Thresholds", "compare_images", "compare_runs", "first_divergence", "summarize", "text_similarity"]
