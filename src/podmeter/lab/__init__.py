"""podmeter.lab."""
