"""Drafters: the proposers (n-gram, suffix, draft model, EAGLE head) and what they share."""
