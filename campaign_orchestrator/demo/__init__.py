"""Tiny real models for the demo campaigns, built locally from a seed (there is no model hub here).

``recipe`` and ``cipher`` are pure Python; ``build`` imports torch and trains the models.
"""
