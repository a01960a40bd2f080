"""The trial lifecycle: one attempt start to finish (lifecycle), what it ran (fingerprints,
provenance), what it cost (costs), and where trials run (executors)."""
