"""Grading: filter a patch, apply it in a fresh container, run the hidden tests, judge by SWE-bench's rules."""
