"""Ray Serve's pluggable request router for the engine deployment, deciding with
spanserve.cluster.routing. The gateway passes each request's route keys as the `route` keyword;
replica loads are Ray Serve's cached queue lengths. The ranks returned are the chosen replica
alone, then every other replica: Ray Serve takes the first rank with a replica under
max_ongoing_requests, so a full replica is passed over as well as one over the load bound."""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from spanserve.cluster.routing import RouteKey, SegmentRouter

# Tokens a replica's pool is assumed to hold until it reports its own (record_routing_stats).
DEFAULT_CAPACITY_TOKENS = 1 << 16


class SegmentRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, slack: float = 0.25, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS,
                         **_: Any) -> None:
        self._router = SegmentRouter(capacity=capacity_tokens, slack=slack)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        reported = [int(r.routing_stats.get("pool_tokens", 0)) for r in candidate_replicas]
        if any(reported):
            self._router.placement.capacity = min(x for x in reported if x)
        cache = self.replica_queue_len_cache
        loads = {name: cache.get(r.replica_id) or 0 for name, r in by_name.items()}
        chosen = self._router.route(_route_keys(pending_request), loads)
        rest = sorted((r for name, r in by_name.items() if name != chosen),
                      key=lambda r: (loads[r.replica_id.unique_id], r.replica_id.unique_id))
        return [[by_name[chosen]], rest] if rest else [[by_name[chosen]]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._router.placement.forget(replica_id.unique_id)


def _route_keys(pending: PendingRequest | None) -> list[RouteKey]:
    if pending is None:
        return []
    keys = pending.kwargs.get("route")
    if keys is None and len(pending.args) > 1:
        keys = pending.args[1]
    return [k for k in keys or [] if isinstance(k, RouteKey)]
