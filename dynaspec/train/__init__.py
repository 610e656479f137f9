"""Training drafters on this machine (the EAGLE-style head: draft_head.py, its corpus:
corpus.py)."""
