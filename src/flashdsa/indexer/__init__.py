"""indexer op family."""
