"""The coordinator role: pure placement/routing policy (policy.py) and, later, its service."""
