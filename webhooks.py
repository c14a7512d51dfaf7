"""The Procfile's `webhooks` process: rq workers that deliver webhook events from their own queue.

    python webhooks.py [--burst] [--processes N]

Each delivery process is a plain forking rq worker on every lane of
`settings.webhook_queue` (hooks/lanes.py), running hooks/delivery.py's tries
and taking them from the tenants and receivers in turn; with more than one
(TTS_WEBHOOK_WORKERS), this process supervises them (processes/supervisor.py),
so that a slow receiver holds its share of them, not all. Events are made
and queued by the synthesis worker and the web process (hooks/events.py);
callback URLs are checked and registered by the web process
(web/callbacks.py). Never imports torch or the web tier.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from redis.exceptions import RedisError
from rq import Worker

from common import connect
from hooks import delivery, lanes
from hooks.delivery import deliver as deliver  # tries are queued under the name `webhooks.deliver` (DELIVER)
from processes import process
from processes.supervisor import Child, RestartPolicy, Supervisor

logger = logging.getLogger("webhooks")

# RQ imports a try's function by its name as it runs the try: one an earlier release queued under the module's
# former path finds it there.
sys.modules.setdefault("work.delivery", delivery)

# A delivery process that fails is started again a second later, however often: it holds no state worth giving up.
RESTART = RestartPolicy(max_failures=None, first_delay=1.0, max_delay=1.0)


class DeliveryWorker(lanes.TakesTurns, process.StopAware, Worker):
    """RQ's forking worker on the webhook lanes, taking them in turn, told apart from a crash when it stops on
    SIGTERM; its upkeep also gives up the events whose tries were lost (delivery.sweep)."""

    def run_maintenance_tasks(self) -> None:
        super().run_maintenance_tasks()
        try:
            gone = delivery.sweep(self.connection, self.turns.settings)
        except RedisError as exc:
            logger.warning("expired webhook events left for the next upkeep: Redis said %s", exc)
            return
        if gone:
            logger.warning("%d webhook registration(s) and event(s) expired without their tries", gone)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Deliver webhook events (an rq worker on the webhook queue)")
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        metavar="N",
        help="delivery processes to run (default TTS_WEBHOOK_WORKERS): a slow receiver holds at most its lane's share",
    )
    args = parser.parse_args(argv)
    settings = process.settings_from_env()
    if settings is None:
        return 2
    processes = settings.webhook_workers if args.processes is None else args.processes
    if processes > 1 and not args.burst:
        one = [sys.executable, os.path.abspath(__file__), "--processes", "1"]
        logger.info("delivering webhooks with %d processes", processes)
        return Supervisor("webhook", [Child(one) for _ in range(processes)], RESTART).run()
    if settings.webhook_secret is None and not settings.tenant_webhook_secrets:
        logger.warning("TTS_WEBHOOK_SECRET is not set: the web process refuses callback_url, so no event comes")
    redis = connect.sync_client(settings, health_check_interval=10)
    delivery.bind(settings, redis)

    def make(generation: int) -> DeliveryWorker:
        queues = delivery.lane_queues(redis, settings)
        worker = DeliveryWorker(queues, connection=redis, serializer=delivery.SERIALIZER, log_job_description=False)
        worker.turns = lanes.Turns(redis, settings, worker.name, delivery.TRY_LIMIT + lanes.CLAIM_SLACK)
        return worker

    # The scheduler puts retries back on the queue once their delay is over.
    return process.serve(
        redis, make, finite=args.burst, burst=args.burst, with_scheduler=True, logging_level=logging.getLogger().level
    )


if __name__ == "__main__":
    raise SystemExit(main())
