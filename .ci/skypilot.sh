#!/usr/bin/env bash
# CI: skypilot/*.yaml parse with SkyPilot's own loader, offline (no cloud credentials), in a venv of its
# own: SkyPilot is no dependency of NanoRL or of the main suite (there, tests/test_skypilot_parse.py skips).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .sky-venv
.sky-venv/bin/python -m pip install -q --upgrade pip
.sky-venv/bin/python -m pip install -q skypilot==0.14.1 pyyaml pytest
.sky-venv/bin/python -m pytest -q tests/test_skypilot_parse.py
