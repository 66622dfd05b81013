"""The KV-event indexer: one process (`manage.py run_kv_indexer`) that subscribes to every registered engine
instance's ZMQ publisher, applies their event batches in order to the index (routing.services.apply_batch), replays
what it missed, and health-checks the instances; a thread of it follows the tenants' ready caches' own block events
over the data plane (routing.cache_follower) (docs/routing.md).

Ordering: batches apply strictly in seq order per instance. On start, on a new subscription and on a gap, the
missing batches are asked of the instance's replay socket (vLLM keeps `buffer_steps` of them); a gap it cannot fill
is counted (`gaps`) and skipped, and blocks whose parent the index never saw stay unindexed (never advertised). A seq
that goes back to 0 is a restarted engine: its index is dropped and refilled. An instance whose `/health` fails for
KCAAS_ROUTING_STALE_SECONDS is lost (its index dropped) until it answers again.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field

import zmq
from django.conf import settings
from django.db import close_old_connections, connections
from django.db.utils import DatabaseError

from kcaas.kv_events import END_SEQ, EventFormatError, decode_batch
from routing import services
from routing.cache_follower import CacheFollower
from routing.engine_load import read_queue
from routing.models import EngineInstance, InstanceState

logger = logging.getLogger("kcaas.routing.indexer")
REPLAY_TIMEOUT_MS = 2000
HEALTH_TIMEOUT_S = 2.0


@dataclass
class Subscription:
    instance_id: uuid.UUID
    events_endpoint: str
    replay_endpoint: str
    api_base: str
    next_seq: int
    socket: zmq.Socket
    last_healthy: float = field(default_factory=time.monotonic)
    needs_replay: bool = False  # set by the health thread when a lost instance answers again


class Indexer:
    def __init__(
        self,
        *,
        refresh_s: float = 1.0,
        health_s: float = 2.0,
        stale_s: float | None = None,
        caches: CacheFollower | None = None,
        cache_poll_s: float | None = None,
    ):
        self.caches = caches if caches is not None else CacheFollower()
        self.cache_poll_s = settings.KCAAS_ROUTING_CACHE_POLL_SECONDS if cache_poll_s is None else cache_poll_s
        self.ctx = zmq.Context.instance()
        self.poller = zmq.Poller()
        self.subs: dict[uuid.UUID, Subscription] = {}
        self.by_socket: dict[zmq.Socket, Subscription] = {}
        self.refresh_s, self.health_s = refresh_s, health_s
        self.stale_s = settings.KCAAS_ROUTING_STALE_SECONDS if stale_s is None else stale_s
        self.stop = threading.Event()

    # ---- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> None:
        health = threading.Thread(target=self._health_loop, name="kcaas-indexer-health", daemon=True)
        caches = threading.Thread(target=self._caches_loop, name="kcaas-indexer-caches", daemon=True)
        health.start()
        caches.start()
        try:
            self._loop()
        finally:
            for sub in list(self.subs.values()):
                self._close(sub)
            health.join(timeout=self.health_s + HEALTH_TIMEOUT_S + 1)
            caches.join(timeout=self.cache_poll_s + 30)
            connections.close_all()

    def _loop(self) -> None:
        next_refresh = 0.0
        while not self.stop.is_set():
            if time.monotonic() >= next_refresh:
                self._guarded(self.refresh)
                next_refresh = time.monotonic() + self.refresh_s
            if not self.by_socket:  # no engine to hear: zmq's poll of nothing returns at once (a busy loop)
                self.stop.wait(self.refresh_s)
                continue
            for sock, _ in self.poller.poll(timeout=int(self.refresh_s * 1000)):
                sub = self.by_socket.get(sock)
                if sub is None:
                    continue
                frames = sock.recv_multipart()
                self._guarded(lambda sub=sub, frames=frames: self.on_frames(sub, frames))
            for sub in list(self.subs.values()):
                if sub.needs_replay:
                    sub.needs_replay = False
                    self._guarded(lambda sub=sub: self.replay(sub))

    def _guarded(self, step) -> None:
        """A database outage never ends the indexer: the step is logged and dropped (a lost batch is a gap that
        the next one replays)."""
        try:
            step()
        except DatabaseError as exc:
            logger.warning("indexer: the database is unavailable (%s); retrying", exc)
            close_old_connections()
            time.sleep(0.5)

    def refresh(self) -> None:
        """Subscribe to instances registered since, drop those deregistered."""
        close_old_connections()
        wanted = {i.id: i for i in EngineInstance.objects.all()}
        for instance_id in set(self.subs) - set(wanted):
            self._close(self.subs[instance_id])
        for instance_id, instance in wanted.items():
            if instance_id not in self.subs:
                self._open(instance)

    def _open(self, instance: EngineInstance) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(instance.events_endpoint)
        sub = Subscription(
            instance.id, instance.events_endpoint, instance.replay_endpoint, instance.api_base, instance.next_seq, sock
        )
        self.subs[instance.id], self.by_socket[sock] = sub, sub
        self.poller.register(sock, zmq.POLLIN)
        if instance.state == InstanceState.LIVE:
            self.replay(sub)  # what was published before this subscription (or while the indexer was down)

    def _close(self, sub: Subscription) -> None:
        self.poller.unregister(sub.socket)
        sub.socket.close(linger=0)
        self.subs.pop(sub.instance_id, None)
        self.by_socket.pop(sub.socket, None)

    # ---- batches --------------------------------------------------------------------------------------------------
    def on_frames(self, sub: Subscription, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            logger.warning("indexer: a malformed message from %s (%d frames)", sub.events_endpoint, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        if seq < sub.next_seq:
            if seq != 0:
                return  # already applied (a replay overtook the live stream)
            services.instance_restarted(instance_id=sub.instance_id)  # the engine started over
            sub.next_seq = 0
        if seq > sub.next_seq:
            self.replay(sub)
            if seq < sub.next_seq:
                return
            if seq > sub.next_seq:  # not replayable: skip the gap, count it
                services.gap_skipped(instance_id=sub.instance_id, next_seq=seq)
                sub.next_seq = seq
        self.apply(sub, seq, frames[2])

    def apply(self, sub: Subscription, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventFormatError as exc:
            logger.warning("indexer: batch %d of %s is not vLLM's event format: %s", seq, sub.events_endpoint, exc)
            services.gap_skipped(instance_id=sub.instance_id, next_seq=seq + 1)
            sub.next_seq = seq + 1
            return
        if services.apply_batch(instance_id=sub.instance_id, seq=seq, batch=batch):
            sub.next_seq = seq + 1
        else:  # lost, deregistered, or its next seq moved (reloaded from the database)
            sub.next_seq = (
                EngineInstance.objects.filter(id=sub.instance_id).values_list("next_seq", flat=True).first() or 0
            )

    def replay(self, sub: Subscription) -> None:
        """Ask the instance's replay socket for every batch from sub.next_seq and apply them in order."""
        if not sub.replay_endpoint:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        try:
            sock.connect(sub.replay_endpoint)
            sock.send_multipart([b"", sub.next_seq.to_bytes(8, "big")])
            while True:
                frames = sock.recv_multipart()  # [b"", topic, seq, payload]
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                seq = int.from_bytes(frames[2], "big")
                if seq == sub.next_seq:
                    self.apply(sub, seq, frames[3])
        except zmq.Again:
            logger.info("indexer: no replay from %s within %d ms", sub.replay_endpoint, REPLAY_TIMEOUT_MS)
        finally:
            sock.close(linger=0)

    # ---- caches ---------------------------------------------------------------------------------------------------
    def _caches_loop(self) -> None:
        try:
            while not self.stop.is_set():
                close_old_connections()
                try:
                    self._guarded(self.caches.step)
                except Exception:  # logged; the next round tries again, the thread never dies
                    logger.exception("indexer: a round over the caches failed")
                self.stop.wait(self.cache_poll_s)
        finally:
            self.caches.close()
            connections.close_all()

    # ---- health ---------------------------------------------------------------------------------------------------
    def _health_loop(self) -> None:
        try:
            while not self.stop.wait(self.health_s):
                for sub in list(self.subs.values()):
                    try:
                        self._check(sub)
                    except DatabaseError:
                        close_old_connections()
        finally:
            connections.close_all()

    def _check(self, sub: Subscription) -> None:
        try:
            with urllib.request.urlopen(f"{sub.api_base}/health", timeout=HEALTH_TIMEOUT_S) as answer:
                healthy = answer.status == 200
        except OSError:
            healthy = False
        now = time.monotonic()
        if healthy:
            sub.last_healthy = now
            queue = read_queue(sub.api_base, HEALTH_TIMEOUT_S)
            if services.mark_healthy(instance_id=sub.instance_id, queue=queue):
                sub.needs_replay = True  # what it published while it was lost
        elif now - sub.last_healthy > self.stale_s and services.mark_lost(instance_id=sub.instance_id):
            logger.warning("indexer: instance %s is lost (no health for %.0f s)", sub.instance_id, self.stale_s)
            sub.next_seq = 0
