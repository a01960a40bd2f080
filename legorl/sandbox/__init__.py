"""Sandboxes: one fresh container per trial or grading run."""
