"""Pin owners and limits in the engine: each owner's pins stay within its quota and all pins
within the budget, pin requests in flight together included; a failed or aborted pin request
gives its reservation back; a key is found only in its own namespace."""
from __future__ import annotations

from typing import Any

import pytest

from spanserve.engine.layout import Segment
from engine_helpers import make_engine
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("pins"))
    return str(path)


def seg(key: str, blocks: int, start: int = 10) -> Segment:
    return Segment(token_ids=list(range(start, start + 4 * blocks)), kind="plus", key=key)


def drain(engine: Any) -> None:
    while engine.has_unfinished():
        engine.step()


def test_quota_per_owner_and_budget_for_all(model_dir: str) -> None:
    # 64 blocks of 4 tokens: budget 32 blocks (pin_fraction 0.5), quota 16 per owner
    engine = make_engine(model_dir, num_blocks=64, block_size=4, pin_quota=0.25)
    engine.pin([seg("a1", 10)], namespace="ns-a", tenant="a")
    with pytest.raises(ValueError, match="only 6 of this tenant's pin quota"):
        engine.pin([seg("a2", 7, 100)], namespace="ns-a", tenant="a")  # queued with a1: 17 > 16
    drain(engine)
    assert engine.pins.held_by("a") == 10
    engine.pin([seg("b1", 16, 100)], namespace="ns-b", tenant="b")
    with pytest.raises(ValueError, match="only 6 of the pin budget"):
        engine.pin([seg("c1", 7, 200)], namespace="ns-c", tenant="c")  # 10 + 16 + 7 > 32
    drain(engine)
    assert engine.pins.num_blocks_held == 26 and engine.pins.num_segments == 2
    assert not engine.unpin("b1", namespace="ns-a")  # not in a's namespace
    assert engine.unpin("b1", namespace="ns-b") and engine.pins.held_by("b") == 0
    engine.pin([seg("c1", 7, 200)], namespace="ns-c", tenant="c")
    drain(engine)
    assert engine.pins.held_by("c") == 7


def test_an_aborted_pin_request_gives_its_blocks_back(model_dir: str) -> None:
    engine = make_engine(model_dir, num_blocks=64, block_size=4, pin_quota=0.25)
    req = engine.pin([seg("a1", 16)], namespace="ns-a", tenant="a")
    assert engine.pins.held_by("a") == 16
    engine.abort(req.request_id)
    assert engine.pins.held_by("a") == 0 and engine.pins.num_segments == 0
    engine.pin([seg("a1", 16)], namespace="ns-a", tenant="a")
    drain(engine)
    assert engine.pins.held_by("a") == 16


def test_repinning_a_key_replaces_the_owners_own_pin(model_dir: str) -> None:
    engine = make_engine(model_dir, num_blocks=64, block_size=4)
    engine.pin([seg("k", 4)], namespace="ns", tenant="a")
    drain(engine)
    (old,) = [p.blocks for p in engine.pins.pins.values()]
    engine.pin([seg("k", 4, 100)], namespace="ns", tenant="a")
    drain(engine)
    (new,) = [p.blocks for p in engine.pins.pins.values()]
    assert engine.pins.held_by("a") == 4 and not {b.id for b in old} & {b.id for b in new}
    assert all(b.ref_cnt == 0 for b in old) and all(b.ref_cnt == 1 for b in new)  # only the pin holds them
    assert engine.unpin("k", namespace="ns") and engine.pins.held_by("a") == 0
    assert all(b.ref_cnt == 0 for b in new) and engine.pool.num_free == 64


def test_without_tenants_the_budget_is_the_only_limit(model_dir: str) -> None:
    engine = make_engine(model_dir, num_blocks=64, block_size=4, pin_fraction=0.5)
    engine.pin([seg("x", 32)])
    drain(engine)
    assert engine.pins.held_by("") == 32
    with pytest.raises(ValueError, match="pin budget"):
        engine.pin([seg("y", 1, 300)])
