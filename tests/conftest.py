import pytest

from redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A redis-server of this module's own (each xdist worker starts its own)."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
