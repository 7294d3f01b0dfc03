"""Dashboard tests."""
