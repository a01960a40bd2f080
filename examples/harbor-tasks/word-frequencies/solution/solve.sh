#!/bin/bash
set -e
cat > /app/words.py <<'PY'
import re
from collections import Counter


def top_words(text: str, k: int) -> list[tuple[str, int]]:
    counts = Counter(w.lower() for w in re.findall(r"[A-Za-z]+", text))
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
PY
