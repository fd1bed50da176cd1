"""`spanserve serve-cluster`: start (or join) a Ray instance and run the replica application."""
from __future__ import annotations

import faulthandler
import logging
import signal
import time
from pathlib import Path
from typing import Any

from spanserve.cluster.app import ClusterOptions, build_app

log = logging.getLogger("spanserve")


def start_ray(address: str | None, num_cpus: float, object_store_bytes: int) -> None:
    """`address` None: a private Ray instance on loopback, sized for this machine; else attach
    ("auto" finds a cluster started with `ray start` on this node; "ray://host:10001" a remote
    one through Ray Client)."""
    import ray

    if address:
        # ship this spanserve with the job: the cluster's nodes need not have it installed
        import spanserve

        ray.init(address=address, log_to_driver=False,
                 runtime_env={"py_modules": [str(Path(spanserve.__file__).parent)]})
        return
    # "local": a new instance even where `ray start` runs one on this machine (None would join it)
    ray.init(address="local", num_cpus=max(1, int(num_cpus + 0.999)), object_store_memory=object_store_bytes,
             include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)


def run_application(opts: ClusterOptions, host: str, port: int) -> Any:
    """Deploys the application and waits for it to be healthy; returns the gateway's handle."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_app(opts), name="spanserve", route_prefix="/")


def stop(drain_s: float = 60.0) -> None:
    """Serve's shutdown (replicas drain their requests), then Ray's. A Serve shutdown that has not
    returned after `drain_s` (seen on a loaded 2-core machine) is left behind: Ray's shutdown stops
    the local instance's processes either way, so Ctrl-C always ends the command."""
    import threading

    import ray
    from ray import serve

    try:
        done = threading.Thread(target=serve.shutdown, name="serve-shutdown", daemon=True)
        done.start()
        done.join(drain_s)
        if done.is_alive():
            log.warning("Ray Serve did not shut down within %.0f s; stopping Ray", drain_s)
    finally:
        ray.shutdown()


def serve_cluster(opts: ClusterOptions, address: str | None, host: str, port: int,
                  object_store_bytes: int = 256 << 20) -> int:
    """Blocks until interrupted; the exit status (1 if the application never came up). SIGUSR1
    prints every thread's stack to stderr (a shutdown that does not end says where it waits)."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if address is None:  # the replicas run here: a wrong model or option is an error now, not in a log
        from spanserve.model.loader import resolve_model

        resolve_model(opts.model)
        log.info("replica runtime: %s", opts.engine_config().resolve().summary())
    start_ray(address, opts.replicas * opts.replica_cpus + 1, object_store_bytes)
    try:
        log.info("starting %d replicas of %s ...", opts.replicas, opts.model)
        try:
            run_application(opts, host, port)
        except RuntimeError as e:  # a replica failed to start: Ray Serve's message says why
            log.error("the application did not start: %s", e)
            return 1
        log.info("serving at http://%s:%d/v1 (%d replicas, segment-aware routing)", host, port, opts.replicas)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log.info("interrupted: stopping Ray Serve and Ray")
        return 130
    finally:
        stop()
