"""Task sets: import SWE-bench-schema rows; build SWE-smith-style tasks offline from sdists."""
