"""Topics paused because the relay's configuration is wrong for them.

An unknown topic (auto-create off), a missing ACL or failed authentication is
not the row's fault: burning the rows' attempts would turn an operator's
five-minute fix into a pile of ``failed`` rows. Instead the topic is paused:
its rows go back to ``retryable`` with the attempt refunded, the claim skips
the topic, and every ``paused_topic_retry`` seconds one claim lets its rows
through again as a probe. A delivered row resumes the topic; another
configuration fault pauses it for one more period (under its new reason, if
that changed). A paused topic with no row left waiting (an operator deleted or
moved them) is resumed by the relay's periodic backlog sample.

The relay stays *ready* while topics are paused (other topics still flow, and a
sidecar relay must not take its service's pod out of rotation); the paused
topics and their reasons are listed in the ``/healthz/ready`` body, in the
``outbox_topic_paused`` gauge and in a ``topic-paused`` log line.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from prometheus_client import Gauge

from outboxkit.runtime.logs import log_event

__all__ = ["PausedTopics"]

log = logging.getLogger("outboxkit.relay.pauses")

_ADVICE = {
    "unknown-topic": "the topic does not exist and the broker does not auto-create topics: "
    "create it (or fix the topic name the service writes)",
    "authorization": "the relay's principal may not write to this topic: grant it WRITE "
    "(and IDEMPOTENT_WRITE on the cluster for older brokers)",
    "authentication": "the relay cannot authenticate to Kafka: check the SASL/SSL settings in "
    "--kafka-config / OUTBOXKIT_KAFKA_CONFIG",
}


@dataclass
class _Pause:
    reason: str
    error: str
    since: float
    probe_at: float


class PausedTopics:
    def __init__(self, *, retry_interval: float, gauge: Gauge) -> None:
        self.retry_interval = retry_interval
        self._gauge = gauge
        self._paused: dict[str, _Pause] = {}
        self._lock = threading.Lock()

    def pause(self, topic: str, reason: str, error: str, rows: int) -> None:
        """Pause ``topic`` (or keep it paused) until the next probe.

        A pause under a new reason moves the gauge to the new label (the old one
        is removed) and is logged again: it is a new fault to act on.
        """
        now = time.monotonic()
        with self._lock:
            current = self._paused.get(topic)
            self._paused[topic] = _Pause(
                reason=reason,
                error=error,
                since=current.since if current else now,
                probe_at=now + self.retry_interval,
            )
            if current is not None and current.reason == reason:
                return  # still paused: one line when it starts, one when it ends
            if current is not None:
                self._clear_gauge(topic, current.reason)
            self._set_gauge(topic, reason)
        log_event(
            log,
            "topic-paused",
            level=logging.ERROR,
            topic=topic,
            reason=reason,
            error=error,
            action=_ADVICE.get(reason, "check the relay's Kafka configuration"),
            rows_returned=rows,
            probe_every_s=self.retry_interval,
            **({"previous_reason": current.reason} if current is not None else {}),
        )

    def resume(self, topic: str, *, cause: str = "delivered") -> None:
        """Lift the pause: ``cause`` is ``delivered`` (a probe got through) or
        ``no-rows-left`` (nothing of the topic is waiting any more)."""
        with self._lock:
            pause = self._paused.pop(topic, None)
            if pause is None:
                return
            self._clear_gauge(topic, pause.reason)
        log_event(
            log,
            "topic-resumed",
            topic=topic,
            reason=pause.reason,
            cause=cause,
            paused_for_s=round(time.monotonic() - pause.since, 3),
        )

    # The gauge follows the state under the lock; a failing metrics call is
    # logged and never breaks the loop (it runs after a finalize committed).
    def _set_gauge(self, topic: str, reason: str) -> None:
        try:
            self._gauge.labels(topic=topic, reason=reason).set(1)
        except Exception as exc:
            log_event(log, "metrics-update-failed", level=logging.WARNING, error=str(exc))

    def _clear_gauge(self, topic: str, reason: str) -> None:
        try:
            self._gauge.remove(topic, reason)
        except KeyError:
            pass  # never set (older prometheus-client raises where newer ones ignore)
        except Exception as exc:
            log_event(log, "metrics-update-failed", level=logging.WARNING, error=str(exc))

    def excluded(self) -> frozenset[str]:
        """Topics the next claim must skip (paused, probe not yet due)."""
        now = time.monotonic()
        with self._lock:
            return frozenset(t for t, p in self._paused.items() if p.probe_at > now)

    def paused_topics(self) -> frozenset[str]:
        """Every paused topic, whether or not its probe is due."""
        with self._lock:
            return frozenset(self._paused)

    def details(self) -> dict[str, str]:
        with self._lock:
            return {t: f"{p.reason}: {p.error}" for t, p in sorted(self._paused.items())}

    def __contains__(self, topic: object) -> bool:
        with self._lock:
            return topic in self._paused
