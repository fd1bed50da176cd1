"""The disk tier against another local user: private directories and files whatever the umask,
directories open to others or owned by someone else refused, no symlink followed on write or
read, and nothing indexed at start-up but regular files named and sized as the tier writes them."""
import os
import stat
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from spanserve.cache.tiers.disk import DiskTier
from spanserve.cache.tiers.payload import BlockKV, BlockShape, PayloadCodec

SHAPE = BlockShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
FP = bytes(range(16))
CODEC = PayloadCodec(SHAPE, FP, b"disk-test-secret-0123456789")
BUDGET = 16 * SHAPE.payload_bytes


def _block(key: int) -> BlockKV:
    g = torch.Generator().manual_seed(key)
    return BlockKV(key, (1, 2, 3, 4), torch.randn(SHAPE.dims, generator=g).to(SHAPE.dtype))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_umask():
    """umask 0: whatever modes the tier ends up with, it chose them."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_directories_are_0700_and_files_0600(tmp_path, open_umask):
    disk = DiskTier(tmp_path / "kv", BUDGET, CODEC)
    disk.store_many([_block(k) for k in (1, 2, 3)])
    assert _mode(tmp_path / "kv") == 0o700 and _mode(disk.dir) == 0o700
    files = sorted(disk.dir.iterdir())
    assert [f.name for f in files] == [f"{k:032x}.kv" for k in (1, 2, 3)]  # no temporary file left
    assert all(_mode(f) == 0o600 and f.stat().st_uid == os.geteuid() for f in files)
    assert all(torch.equal(b.kv, _block(k).kv) for k, b in zip((1, 2, 3), disk.load_many([1, 2, 3])))


def test_a_directory_open_to_others_is_refused(tmp_path, open_umask):
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    with pytest.raises(ValueError, match=r"mode 0755, open to other users.*chmod 700"):
        DiskTier(root, BUDGET, CODEC)
    root.chmod(0o700)
    sub = root / FP.hex()
    sub.mkdir(mode=0o750)  # the model's own directory is checked too
    with pytest.raises(ValueError, match="mode 0750"):
        DiskTier(root, BUDGET, CODEC)
    sub.chmod(0o700)
    assert len(DiskTier(root, BUDGET, CODEC)) == 0


def test_a_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() == 0:  # root can make one
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
    else:
        theirs = Path("/")  # root's
    with pytest.raises(ValueError, match="belongs to user id .*give a path of your own"):
        DiskTier(theirs, BUDGET, CODEC)
    plain_file = tmp_path / "file"
    plain_file.write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory|not writable"):
        DiskTier(plain_file, BUDGET, CODEC)


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path / "kv", BUDGET, CODEC)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, disk.dir / ".tmp-planted")
    # and at a name derived from the key and the writing thread, as a predictable scheme would pick
    os.symlink(victim, disk._path(7).with_suffix(f".tmp{threading.get_ident()}"))
    names = iter(["planted", "fresh0", "fresh1"])  # the first name mkstemp tries is the planted one
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: names)
    disk.store_many([_block(7)])
    assert victim.read_bytes() == b"precious"
    assert os.path.islink(disk.dir / ".tmp-planted")  # exclusive create: the link was skipped, not opened
    assert torch.equal(disk.load_many([7])[0].kv, _block(7).kv)
    assert disk.stats.errors == 0


def test_a_link_at_a_block_name_is_not_followed(tmp_path):
    disk = DiskTier(tmp_path / "kv", BUDGET, CODEC)
    disk.store_many([_block(1), _block(2)])
    victim = tmp_path / "victim"
    good = disk._path(1).read_bytes()
    victim.write_bytes(good)  # even a valid payload behind the link is not read through it
    disk._path(1).unlink()
    os.symlink(victim, disk._path(1))
    assert disk.load_many([1, 2])[0] is None  # a miss, counted, forgotten
    assert disk.stats.bad_payloads == 1 and disk.contains_many([1]).tolist() == [False]
    assert victim.read_bytes() == good and not disk._path(1).exists()  # the link went, its target stayed
    # a link planted before start-up is not indexed, and a write replaces it instead of writing through
    os.symlink(victim, disk._path(3))
    again = DiskTier(tmp_path / "kv", BUDGET, CODEC)
    assert again.contains_many([2, 3]).tolist() == [True, False] and again.ignored == 1
    again.store_many([_block(3)])
    assert victim.read_bytes() == good and not os.path.islink(again._path(3))
    assert torch.equal(again.load_many([3])[0].kv, _block(3).kv)


def test_only_the_tiers_own_files_are_indexed(tmp_path):
    disk = DiskTier(tmp_path / "kv", BUDGET, CODEC)
    disk.store_many([_block(0xABC)])
    good = disk._path(0xABC).read_bytes()
    d = disk.dir
    for name in ("0x1f.kv", "-1.kv", "1f.kv", f"{0x1F:032X}.kv", f"{0x1F:031x}.kv", f"{0x1F:033x}.kv",
                 f"{0x1F:032x}.kv.bak", ".tmp-leftover"):
        (d / name).write_bytes(good)
    (d / f"{0x21:032x}.kv").write_bytes(good[:-1])  # the right name, another size
    os.symlink(d / f"{0xABC:032x}.kv", d / f"{0x22:032x}.kv")  # the right name, a link
    (d / f"{0x23:032x}.kv").mkdir()  # the right name, a directory
    os.mkfifo(d / f"{0x24:032x}.kv")  # the right name, a FIFO (reading it would block)
    again = DiskTier(tmp_path / "kv", BUDGET, CODEC)
    assert len(again) == 1 and again.ignored == 12
    assert again.contains_many([0xABC, 0x1F, -1, 0x21, 0x22, 0x23, 0x24]).tolist() == [True] + [False] * 6
    assert torch.equal(again.load_many([0xABC])[0].kv, _block(0xABC).kv)
    # a FIFO swapped in after start-up under an indexed name: refused without blocking the read
    again._path(0xABC).unlink()
    os.mkfifo(again._path(0xABC))
    assert again.load_many([0xABC]) == [None] and again.stats.bad_payloads == 1
