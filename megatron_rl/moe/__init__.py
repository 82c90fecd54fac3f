"""Mixture-of-Experts specifics: the routing-replay choice, routing replay (R2, R3) and
routing-drift metrics."""
