"""Evaluation: offline models, evaluation texts, and length-aware perplexity measurement."""
