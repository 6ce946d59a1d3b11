"""Small utilities with no knowledge of attention (atomic result files)."""
