"""Scheduling: filters, scorers and pickers chosen by a profile; pure functions over endpoint state."""
