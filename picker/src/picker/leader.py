"""Active-passive replicas: one picker of the pool holds a coordination.k8s.io/v1 Lease and is
the only one whose readiness says SERVING; the others are warm standbys (app.py).

Written here rather than taken from `kubernetes.leaderelection` (kubernetes 37.0.2), which does
not fit a service that must hand over fast and stop cleanly: its Config exits the process for a
retry period under one second, its run() loops forever with no way to stop it and never releases
the Lease (a rolling update would wait a whole lease duration), a leader that loses the Lease
returns from run() instead of becoming a candidate again, and it does not count
leaseTransitions. The rules below are client-go's (k8s.io/client-go/tools/leaderelection):

- a Lease held by another identity is taken only after it has not changed for its
  leaseDurationSeconds, timed on this replica's own monotonic clock from when the change was
  seen (so clocks of different nodes never compare);
- an empty holderIdentity (a released Lease) is free at once;
- every write is a replace carrying the resourceVersion read: of two candidates, one wins, the
  other gets 409 and stays a standby;
- the leader renews every retry period, and counts itself a leader only until
  renew deadline after its last successful renew (is_leader(), checked by the readiness loop,
  so a renew that hangs in the API call still ends the leadership on time);
- release: holderIdentity "" and leaseDurationSeconds 1;
- a replica competes only while it is a candidate (`candidate`, set by the readiness loop from
  failover.py: warm, that is discovery synced and endpoints scraped, and no live peer acting): a
  pod that has just started never wins a released Lease against a warm standby, which would leave
  the route without a ready picker until it warmed up, and an expired Lease is never taken from a
  leader that rode an API outage through. A leader keeps renewing whatever its warmth (every
  replica sees the same pool). A replica that does not compete still reads the Lease every retry
  period: failover.py needs to know whether the holder still renews.

Blocking API calls run in the elector's own thread (run()); the event loop only reads the
state and is told of changes through `on_change`.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from picker.failover import LeaseView

log = logging.getLogger("picker.leader")

# Defaults (the flags' help says why): a SIGTERM hands over within one retry period, a dead
# leader's Lease is taken over within one lease duration (+ one retry period).
LEASE_DURATION = 4      # seconds (Lease.spec.leaseDurationSeconds is whole seconds)
RENEW_DEADLINE = 3.0    # seconds
RETRY_PERIOD = 0.5      # seconds
NEVER_READ = "never read"


@dataclass(frozen=True)
class LeaseSettings:
    name: str
    namespace: str
    identity: str
    lease_duration: int = LEASE_DURATION
    renew_deadline: float = RENEW_DEADLINE
    retry_period: float = RETRY_PERIOD

    def check(self) -> None:
        """client-go's constraints: the leader gives up (renew deadline) before anyone else may
        take the Lease (lease duration), and retries at least once more before giving up."""
        if self.lease_duration < 1:
            raise ValueError("the lease duration must be at least 1 s")
        if not self.renew_deadline < self.lease_duration:
            raise ValueError("the renew deadline must be shorter than the lease duration")
        if not 0 < self.retry_period * 1.2 < self.renew_deadline:
            raise ValueError("the retry period (x 1.2 jitter) must be shorter than the renew "
                             "deadline")

    @property
    def request_timeout(self) -> float:
        """One API call never takes longer than what is left of a renew deadline after a retry."""
        return max(0.2, min(2.0, self.renew_deadline - self.retry_period))


def default_identity() -> str:
    """The pod's name (POD_NAME from the downward API), else the host name (a pod's host name
    is its name too)."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class LeaseElector:
    """One candidate for the Lease. `api` is a kubernetes.client.CoordinationV1Api;
    `on_change(leading)` is called from the elector's thread on every change of this
    replica's leadership."""

    def __init__(self, api: Any, settings: LeaseSettings,
                 on_change: Callable[[bool], None] = lambda leading: None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = _utcnow, candidate: bool = True):
        settings.check()
        self.api = api
        self.s = settings
        self.on_change = on_change
        self.clock = clock
        self.wall = wall
        self.leading = False
        self.candidate = candidate       # may acquire (set from the event loop)
        self.renewed_at = float("-inf")  # clock() of the last successful acquire or renew
        self.holder: str | None = None   # last holder seen
        self._lease: Any = None          # the Lease as last read or written
        self._observed: tuple | None = None
        self._observed_at = float("-inf")
        self._lock = threading.Lock()
        self.transitions = {"acquired": 0, "lost": 0, "released": 0}
        self._last_error: str | None = NEVER_READ  # None: the last Lease request was answered
        self._poke = threading.Event()
        self._call_since: float | None = None  # clock() when the API call in progress started

    # --- state, read by the event loop

    def is_leader(self) -> bool:
        """Leading, and renewed within the renew deadline (a hanging renew ends it on time)."""
        with self._lock:
            return self.leading and self.clock() - self.renewed_at <= self.s.renew_deadline

    def view(self) -> LeaseView:
        """What failover.py needs: leading, the holder, whether Lease requests get answers, and
        how long the Lease has looked unchanged from here."""
        return LeaseView(leader=self.is_leader(), holder=self.holder,
                         reads_ok=self._answered(),
                         unchanged_for=self.clock() - self._observed_at,
                         retry_period=self.s.retry_period)

    def _answered(self) -> bool:
        """The last Lease request got an answer, and none has been waiting for one longer than a
        retry period (an API server that hangs blocks a call up to its timeout)."""
        since = self._call_since
        return self._last_error is None and (
            since is None or self.clock() - since < self.s.retry_period)

    @contextmanager
    def _calling(self):
        self._call_since = self.clock()
        try:
            yield
        finally:
            self._call_since = None

    def poke(self) -> None:
        """Try now rather than at the end of the retry period (a peer handed over)."""
        self._poke.set()

    # --- the elector's thread

    def run(self, stop: threading.Event) -> None:
        """Acquire or renew every retry period until `stop`, then release the Lease if held."""
        log.info("leader election", extra={"lease": f"{self.s.namespace}/{self.s.name}",
                                           "identity": self.s.identity})
        while not stop.is_set():
            self.step()
            self._poke.wait(self.s.retry_period)
            self._poke.clear()
        self.release()

    def step(self) -> None:
        """One attempt: renew (leader), or acquire when the Lease is free or expired."""
        from kubernetes.client.exceptions import ApiException
        try:
            if self.leading and self._lease is not None and self._try_renew():
                self._failing(None)
                return
            lease = self._read()
            if not self.leading and not self.candidate:
                self._failing(None)
                return
            if lease is None:
                self._create()
            elif self._may_take(lease):
                self._write(lease)
            elif self.leading:
                self._set_leading(False, "lost")
            self._failing(None)
        except ApiException as exc:
            if exc.status != 409:  # 409: another candidate wrote first
                self._failing(f"{exc.status} {exc.reason}", status=exc.status)
            self._lease = None
        except Exception as exc:  # noqa: BLE001 - API server unreachable, timeouts: retry
            self._failing(type(exc).__name__, detail=repr(exc))
            self._lease = None
        if self.leading and self.clock() - self.renewed_at > self.s.renew_deadline:
            self._set_leading(False, "lost")

    def _failing(self, error: str | None, status: int | None = None,
                 detail: str | None = None) -> None:
        """Log a failing Lease request once per kind of failure (every retry period would flood
        the log while, say, the Role lacks the Lease rules), and once when requests work again."""
        if error == self._last_error:
            return
        if error is None:
            if self._last_error != NEVER_READ:
                log.info("lease requests work again")
        else:
            log.warning("lease request failed", extra={"status": status,
                                                       "error": detail or error})
        self._last_error = error

    def release(self) -> bool:
        """Give the Lease up at once (holderIdentity "" lets a standby take it without waiting
        for it to expire). True when released."""
        was_leading = self.leading
        if was_leading:
            self._set_leading(False, "released")
        if was_leading and self._lease is None:
            try:
                self._read()
            except Exception:  # noqa: BLE001 - unreachable: the Lease expires after its duration
                return False
        if self._lease is None or self._lease.spec.holder_identity != self.s.identity:
            return False
        spec = self._lease.spec
        spec.holder_identity = ""
        spec.lease_duration_seconds = 1
        spec.renew_time = spec.acquire_time = self.wall()
        try:
            with self._calling():
                self._lease = self.api.replace_namespaced_lease(
                    self.s.name, self.s.namespace, self._lease,
                    _request_timeout=self.s.request_timeout)
        except Exception as exc:  # noqa: BLE001 - it then expires after its duration
            log.warning("lease release failed", extra={"error": repr(exc)})
            return False
        return True

    # --- the steps

    def _read(self) -> Any | None:
        from kubernetes.client.exceptions import ApiException
        try:
            with self._calling():
                lease = self.api.read_namespaced_lease(self.s.name, self.s.namespace,
                                                       _request_timeout=self.s.request_timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        self._observe(lease)
        return lease

    def _observe(self, lease: Any) -> None:
        spec = lease.spec
        record = (spec.holder_identity, spec.renew_time, spec.lease_duration_seconds,
                  lease.metadata.resource_version)
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        if spec.holder_identity != self.holder:
            self.holder = spec.holder_identity
            log.info("lease holder", extra={"holder": self.holder or None,
                                            "identity": self.s.identity})
        self._lease = lease

    def _may_take(self, lease: Any) -> bool:
        holder = lease.spec.holder_identity
        if not holder or holder == self.s.identity:
            return True
        duration = lease.spec.lease_duration_seconds or self.s.lease_duration
        return self.clock() - self._observed_at > duration

    def _try_renew(self) -> bool:
        """The leader's fast path: replace the Lease as last written, without reading it first.
        False (read it, next) when that fails."""
        from kubernetes.client.exceptions import ApiException
        try:
            self._write(self._lease)
            return True
        except ApiException as exc:
            if exc.status != 409:
                log.warning("lease renew failed", extra={"status": exc.status})
            return False
        except Exception as exc:  # noqa: BLE001
            log.warning("lease renew failed", extra={"error": repr(exc)})
            return False

    def _write(self, lease: Any) -> None:
        started = self.clock()
        spec = lease.spec
        now = self.wall()
        if spec.holder_identity != self.s.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + (1 if spec.holder_identity
                                                                      else 0)
        spec.holder_identity = self.s.identity
        spec.lease_duration_seconds = self.s.lease_duration
        spec.renew_time = now
        with self._calling():
            written = self.api.replace_namespaced_lease(self.s.name, self.s.namespace, lease,
                                                        _request_timeout=self.s.request_timeout)
        self._succeeded(written, started)

    def _create(self) -> None:
        from kubernetes import client
        started = self.clock()
        now = self.wall()
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.s.name, namespace=self.s.namespace),
            spec=client.V1LeaseSpec(holder_identity=self.s.identity,
                                    lease_duration_seconds=self.s.lease_duration,
                                    acquire_time=now, renew_time=now, lease_transitions=0))
        with self._calling():
            written = self.api.create_namespaced_lease(self.s.namespace, body,
                                                       _request_timeout=self.s.request_timeout)
        self._succeeded(written, started)

    def _succeeded(self, lease: Any, started: float) -> None:
        """A write went through. The leadership counts from when the call started: the Lease
        was valid for others from no earlier than that."""
        self._observe(lease)
        with self._lock:
            self.renewed_at = started
        if not self.leading:
            self._set_leading(True, "acquired")

    def _set_leading(self, leading: bool, how: str) -> None:
        with self._lock:
            self.leading = leading
            self.transitions[how] += 1
        log.info(f"leadership {how}", extra={"identity": self.s.identity,
                                             "lease": f"{self.s.namespace}/{self.s.name}"})
        self.on_change(leading)


def start_elector(settings: LeaseSettings, on_change: Callable[[bool], None],
                  stop: threading.Event, candidate: bool = True
                  ) -> tuple[LeaseElector, threading.Thread]:
    """An elector on the in-cluster (else KUBECONFIG) credentials, running in its own thread."""
    from kubernetes import client, config

    from picker.discovery.kubernetes import load_config
    try:
        load_config()
    except config.ConfigException as exc:
        raise ValueError(f"--leader-election needs Kubernetes credentials (in-cluster or "
                         f"KUBECONFIG): {exc}") from exc
    elector = LeaseElector(client.CoordinationV1Api(), settings, on_change, candidate=candidate)
    thread = threading.Thread(target=elector.run, args=(stop,), name="picker-leader-election",
                              daemon=True)
    thread.start()
    return elector, thread
