"""verl pointed at specroll (see server_manager.py)."""
