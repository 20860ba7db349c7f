"""Drafter models as plain nn.Modules: EAGLE-1/3 feature drafters (eagle.py) and Medusa heads (medusa.py)."""
