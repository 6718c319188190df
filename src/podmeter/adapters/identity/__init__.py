"""Identity backends: where label-set identities are allocated (``memory`` or ``etcd``)."""

from podmeter.adapters.identity.base import IdentityBackend, IdentityBackendError

__all__ = ["IdentityBackend", "IdentityBackendError"]
