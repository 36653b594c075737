"""tfpar."""
