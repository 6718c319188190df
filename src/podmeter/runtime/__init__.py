"""podmeter.runtime."""
