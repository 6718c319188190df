"""podmeter.adapters.kube."""
