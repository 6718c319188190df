"""podmeter.adapters.metrics."""
