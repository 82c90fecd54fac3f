"""Mixture-of-Experts specifics: routing replay (R2, R3) and routing-drift metrics."""
