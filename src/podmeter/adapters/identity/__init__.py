"""podmeter.adapters.identity."""
