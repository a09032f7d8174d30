"""Strata's services: each is a pure domain (`domain.py`) behind a thin NATS adapter."""
