"""podmeter.adapters."""
