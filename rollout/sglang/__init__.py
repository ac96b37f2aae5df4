"""SGLang: the HTTP client engine (`client.py`), the colocated server launcher and the wire protocol it shares
with the project's own engine server."""
