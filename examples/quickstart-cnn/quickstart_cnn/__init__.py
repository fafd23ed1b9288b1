"""Flower's quickstart CNN, audited by fl-attack."""
