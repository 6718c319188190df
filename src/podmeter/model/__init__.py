"""podmeter.model."""
