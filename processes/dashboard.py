"""rq-dashboard on the service's Redis, reached the way web and worker reach it (common/connect.py).

    python -m processes.dashboard --bind 127.0.0.1 --port 9181     (scripts/dashboard runs it)

rq-dashboard builds its own client from a URL, which cannot say a CA file,
a client certificate or Sentinel; here its app is made by rq-dashboard and
handed the service's client instead. The URL it shows is the one without
credentials. HTTP basic auth: RQ_DASHBOARD_USERNAME and RQ_DASHBOARD_PASSWORD,
read by rq-dashboard's own app.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import rq_dashboard.web
from rq.serializers import JSONSerializer
from rq_dashboard.cli import make_flask_app

from common import connect
from processes import process

logger = logging.getLogger("dashboard")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rq-dashboard on the service's Redis")
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=9181, help="port to listen on")
    args = parser.parse_args(argv)
    settings = process.settings_from_env()
    if settings is None:
        return 2
    client = connect.sync_client(settings, health_check_interval=10)

    def service_client(url: Any, **options: Any) -> tuple[None, Any]:
        # rq-dashboard asks for a client by URL before every request of an
        # instance page: always the service's one, whatever the URL says.
        return None, client

    rq_dashboard.web.from_url = service_client
    username = os.environ.get("RQ_DASHBOARD_USERNAME")
    app = make_flask_app(None, username, os.environ.get("RQ_DASHBOARD_PASSWORD"), "")
    app.config["RQ_DASHBOARD_REDIS_URL"] = (connect.describe(settings),)
    app.config["DEPRECATED_OPTIONS"] = []
    app.config["RQ_DASHBOARD_DISABLE_DELETE"] = False
    # The jobs are stored with RQ's JSON serializer.
    rq_dashboard.web.config.serializer = JSONSerializer
    app.redis_conn = client
    logger.info("rq-dashboard on %s:%d for Redis %s", args.bind, args.port, connect.describe(settings))
    app.run(host=args.bind, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
