"""Trajectory analysis (and, with issue 7, saving and reports)."""
