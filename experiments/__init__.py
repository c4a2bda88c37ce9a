"""Experiments: K-FAC against first-order optimizers on small real tasks."""
