"""The lab API server: an in-memory Kubernetes API server that answers like the real one on the wire.

Modules by concept: ``store`` (objects, global resourceVersion, bounded history), ``registry`` (the verbs),
``watching`` (streams, bookmarks), ``selectors``, ``options`` (list/watch parameters), ``patching``,
``validation``, ``defaults``, ``resources``, ``services`` (ClusterIP and NodePort allocation),
``netvalidation`` (Services and EndpointSlices), ``discovery``, ``tables`` (kubectl's server-side printing),
``protobuf`` (kubectl's namespace create), ``errors`` (Status bodies), ``faults``, ``admin`` (the
``/_lab/`` API), ``app`` (HTTP routing, auth), ``server`` (listener, TLS, kubeconfig, restart) and
``client`` (the admin/fault client used by the CLI and tests).
"""

from podmeter.lab.apiserver.app import LabApiServer, Settings
from podmeter.lab.apiserver.server import RunningServer, serve_forever, write_kubeconfig

__all__ = ["LabApiServer", "RunningServer", "Settings", "serve_forever", "write_kubeconfig"]
