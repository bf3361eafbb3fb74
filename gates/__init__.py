"""gates."""
