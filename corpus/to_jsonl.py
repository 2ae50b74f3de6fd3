#!/usr/bin/env python3
"""Write corpus/sources/{prose,code,ja,chat}.jsonl from the hand-written pieces in corpus/src/.

One JSON object per line and piece, in source order: {"text": ...} for prose, code and ja;
{"messages": [{"role", "content"}, ...]} for chat, parsed from the pieces' ChatML markup, so
`reap-imatrix corpus` renders them with the model's own chat template. Deterministic, standard
library only.

Usage:
    python3 corpus/to_jsonl.py          # (re)write corpus/sources/*.jsonl
    python3 corpus/to_jsonl.py --check  # verify they are up to date
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import DOMAINS, load_pieces  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "sources"
TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n?", re.S)


def messages(piece: str) -> list[dict]:
    turns = [{"role": m.group(1), "content": m.group(2)} for m in TURN.finditer(piece)]
    rebuilt = "".join(f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n" for t in turns)
    if rebuilt.rstrip("\n") != piece.rstrip("\n"):
        raise SystemExit(f"chat piece is not plain ChatML: {piece[:80]!r}")
    return turns


def render() -> dict[str, str]:
    out = {}
    for d in DOMAINS:
        lines = []
        for p in load_pieces(d):
            obj = {"messages": messages(p)} if d == "chat" else {"text": p}
            lines.append(json.dumps(obj, ensure_ascii=False))
        out[d] = "\n".join(lines) + "\n"
    return out


def main() -> int:
    files = render()
    if "--check" in sys.argv[1:]:
        stale = [d for d, t in files.items() if not (OUT / f"{d}.jsonl").is_file() or (OUT / f"{d}.jsonl").read_text(encoding="utf-8") != t]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python3 corpus/to_jsonl.py", file=sys.stderr)
            return 1
        print("corpus/sources/*.jsonl are up to date")
        return 0
    OUT.mkdir(exist_ok=True)
    for d, t in files.items():
        (OUT / f"{d}.jsonl").write_text(t, encoding="utf-8")
        print(f"wrote {OUT / (d + '.jsonl')}: {t.count(chr(10))} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
