"""Blueprints, one per concern."""
