"""Build and fetch tooling shared by make targets, tests, scripts and benchmarks.

Nothing here is part of the shipped runtime or operator: it builds the
loopback Kubernetes control plane, fetches the real demo model pair, and
makes the tiny in-code models.
"""
