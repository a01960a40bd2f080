"""The live dashboard: a small local web server over a run directory's shards, and its static export."""
