"""podmeter.adapters.datapath."""
