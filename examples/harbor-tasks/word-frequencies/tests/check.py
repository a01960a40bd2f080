"""Scores top_words on a few cases; writes the fraction passed to /logs/verifier/reward.json."""
import json
import os
import sys

sys.path.insert(0, "/app")  # test.sh runs this file by path: its folder, not /app, is on sys.path

cases = [
    (("the cat and the hat", 1), [("the", 2)]),
    (("b a b a c", 2), [("a", 2), ("b", 2)]),
    (("Hello, hello! World.", 2), [("hello", 2), ("world", 1)]),
    (("", 3), []),
]
passed = 0
try:
    from words import top_words

    for args, want in cases:
        try:
            passed += top_words(*args) == want
        except Exception:
            pass
except Exception:
    pass
score = passed / len(cases)
reward = 1.0 if score >= float(os.environ["WORDS_MIN_SCORE"]) else 0.0
with open("/logs/verifier/reward.json", "w") as f:
    json.dump({"reward": reward}, f)
print(f"{passed}/{len(cases)} cases")
