#!/bin/bash
# Harbor verifier: pass -> 1, anything else -> 0.
cd /app
PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -p no:cacheprovider /tests/test_fizzbuzz.py
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
