"""Scripts the grading container runs (as text: they are copied in, never imported on the host)."""
