#!/usr/bin/env python3
"""Assemble corpus/calibration.txt and corpus/sections.tsv from corpus/src/.

The hand-written pieces live in corpus/src/<domain>_<n>.txt, one piece per
block, blocks separated by a line containing only "@@@@". Domains are
prose, code, ja and chat.

Pieces are interleaved round-robin (prose, code, ja, chat, prose, code,
...), so every prefix of the output mixes all four domains. There is no
randomness: the same sources always give byte-identical output.

Usage:
    python3 corpus/generate.py          # (re)write calibration.txt and sections.tsv
    python3 corpus/generate.py --check  # verify the committed files are up to date
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
OUT_TEXT = HERE / "calibration.txt"
OUT_SECTIONS = HERE / "sections.tsv"

DOMAINS = ["prose", "code", "ja", "chat"]  # order within a round
DELIM = "@@@@"


def load_pieces(domain: str) -> list[str]:
    pieces: list[str] = []
    files = sorted(SRC.glob(f"{domain}_*.txt"), key=lambda p: int(p.stem.split("_")[1]))
    for path in files:
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        block: list[str] = []
        for line in text.split("\n") + [DELIM]:
            if line == DELIM:
                piece = "\n".join(block).strip("\n")
                if piece:
                    pieces.append(piece)
                block = []
            else:
                block.append(line)
    if not pieces:
        raise SystemExit(f"no pieces for domain {domain!r} in {SRC}")
    return pieces


def build() -> tuple[bytes, str]:
    by_domain = {d: load_pieces(d) for d in DOMAINS}

    # Round-robin interleave: round r takes piece r of each domain, in the
    # fixed order prose, code, ja, chat (a domain that has run out is skipped).
    order = []
    rounds = max(len(p) for p in by_domain.values())
    for r in range(rounds):
        for d in DOMAINS:
            if r < len(by_domain[d]):
                order.append((d, by_domain[d][r]))

    text = bytearray()
    rows = []
    for k, (d, piece) in enumerate(order):
        # Each section is the piece plus its trailing newline; every section
        # except the last also owns the blank line that separates it from the next.
        chunk = piece + "\n" + ("\n" if k + 1 < len(order) else "")
        data = chunk.encode("utf-8")
        start = len(text)
        text += data
        rows.append(f"{start}\t{len(text)}\t{d}\n")
    return bytes(text), "".join(rows)


def summary(text: bytes, sections: str) -> str:
    counts: dict[str, int] = {d: 0 for d in DOMAINS}
    sizes: dict[str, int] = {d: 0 for d in DOMAINS}
    for line in sections.splitlines():
        a, b, d = line.split("\t")
        counts[d] += 1
        sizes[d] += int(b) - int(a)
    lines = [
        f"bytes   {len(text)}",
        f"sha256  {hashlib.sha256(text).hexdigest()}",
        f"sections {sum(counts.values())}",
    ]
    for d in DOMAINS:
        lines.append(f"  {d:<6} {counts[d]:>3} sections {sizes[d]:>7} bytes")
    return "\n".join(lines)


def validate(text: bytes, sections: str) -> list[str]:
    """Structural checks on a (text, sections.tsv) pair; returns problems found."""
    problems: list[str] = []
    try:
        text.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        problems.append(f"not valid UTF-8: {e}")
    expect = 0
    seen_early: set[str] = set()
    for n, line in enumerate(sections.splitlines(), 1):
        a, b, d = line.split("\t")
        start, end = int(a), int(b)
        if start != expect or end <= start:
            problems.append(f"sections.tsv line {n}: {start}..{end} does not follow {expect}")
        if d not in DOMAINS:
            problems.append(f"sections.tsv line {n}: unknown domain {d!r}")
        expect = end
        if start < len(text) // 10:
            seen_early.add(d)
        body = text[start:end]
        n_start, n_end = body.count(b"<|im_start|>"), body.count(b"<|im_end|>")
        if d == "chat" and (n_start == 0 or n_start != n_end):
            problems.append(f"chat section at {start}: {n_start} starts vs {n_end} ends")
        if d != "chat" and (n_start or n_end):
            problems.append(f"{d} section at {start} contains ChatML special tokens")
    if expect != len(text):
        problems.append(f"sections end at {expect}, file has {len(text)} bytes")
    missing = set(DOMAINS) - seen_early
    if missing:
        problems.append(f"first 10% of the file lacks domains {sorted(missing)}")
    if DELIM.encode() in text:
        problems.append("source delimiter leaked into the output")
    return problems


def main(argv: list[str]) -> int:
    text, sections = build()
    problems = validate(text, sections)
    for p in problems:
        print(f"problem: {p}", file=sys.stderr)
    if "--check" in argv[1:]:
        ok = OUT_TEXT.exists() and OUT_TEXT.read_bytes() == text
        ok = ok and OUT_SECTIONS.exists() and OUT_SECTIONS.read_text(encoding="utf-8") == sections
        print(summary(text, sections))
        print("up to date" if ok else "OUT OF DATE: run python3 corpus/generate.py")
        return 0 if ok and not problems else 1
    if problems:
        return 1
    OUT_TEXT.write_bytes(text)
    OUT_SECTIONS.write_text(sections, encoding="utf-8", newline="\n")
    print(summary(text, sections))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
