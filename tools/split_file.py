"""Split a file into equal parts and join them back, checking a SHA-256: for moving a file larger
than one transfer allows (e.g. the SmolLM2 GGUF, 94 MiB) to a machine in several transfers.

    python tools/split_file.py split FILE DIR [--parts 2]   # DIR/NAME.part0 ... + DIR/NAME.sha256
    python tools/split_file.py join OUT PART0 PART1 ... [--sha256 HEX | --sha256-file F]

The same with coreutils: `split -n 2 -d FILE NAME.part` and `cat NAME.part0* > FILE`.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

CHUNK = 1 << 24


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def split(src: Path, out_dir: Path, parts: int) -> list[Path]:
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    out_dir.mkdir(parents=True, exist_ok=True)
    size = src.stat().st_size
    per = -(-size // parts)
    paths = []
    with open(src, "rb") as f:
        for i in range(parts):
            p = out_dir / f"{src.name}.part{i}"
            left = min(per, size - i * per)
            with open(p, "wb") as g:
                while left > 0:
                    block = f.read(min(CHUNK, left))
                    g.write(block)
                    left -= len(block)
            paths.append(p)
    (out_dir / f"{src.name}.sha256").write_text(sha256(src) + "\n")
    return paths


def join(out: Path, parts: list[Path], expect: str | None) -> str:
    tmp = out.with_name(out.name + ".joining")
    with open(tmp, "wb") as g:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(CHUNK):
                    g.write(block)
    digest = sha256(tmp)
    if expect is not None and digest != expect.strip().lower():
        tmp.unlink()
        raise ValueError(f"joined file has SHA-256 {digest}, expected {expect.strip()}: a part is missing, "
                         "truncated or out of order")
    tmp.replace(out)
    return digest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("file", type=Path)
    s.add_argument("dir", type=Path)
    s.add_argument("--parts", type=int, default=2)
    j = sub.add_parser("join")
    j.add_argument("out", type=Path)
    j.add_argument("parts", type=Path, nargs="+")
    j.add_argument("--sha256", default=None)
    j.add_argument("--sha256-file", type=Path, default=None)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "split":
            for p in split(a.file, a.dir, a.parts):
                print(p)
        else:
            expect = a.sha256 or (a.sha256_file.read_text() if a.sha256_file else None)
            print(f"{a.out} {join(a.out, a.parts, expect)}")
    except (OSError, ValueError) as e:
        print(f"split_file: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
