"""podmeter: pod-level network observability for Kubernetes that cannot leak."""

__version__ = "0.1.0"
