"""OpenRLHF pointed at specroll (see loop.py)."""
