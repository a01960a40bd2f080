#!/bin/bash
cd /app
PYTHONDONTWRITEBYTECODE=1 python3 /tests/check.py
