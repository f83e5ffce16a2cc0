"""The sidecar's /metrics endpoint, always in the Prometheus text format.

prometheus_client's own `start_http_server` answers a scraper that prefers OpenMetrics (Prometheus 2.x does)
with ``escaping=underscores``, which renames ``specroll:trainer_lag`` to ``specroll_trainer_lag``: the dashboard
and the alert rules would then find nothing. The text format keeps the names as they are defined.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve `registry` on http://host:port/ (any path) from a daemon thread; returns the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not worth a log line
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="trainer-metrics", daemon=True).start()
    return server
