"""Small, runnable training entry points (used by the package's own resume tests)."""
