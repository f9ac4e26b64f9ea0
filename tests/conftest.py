"""Two tiers. `python -m pytest -q tests` is the fast one: every module's behaviour, each test within seconds.
`--slow` adds the tests marked slow (torchrun Ctrl-C matrices, floods, the GPU-check rehearsal, SmolLM2, the
end-to-end runs to a solved task): each keeps a cheaper test of the same behaviour in the fast tier."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run the slow tier too (tests marked slow)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the slow tier, run only with --slow")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--slow"):
        skip = pytest.mark.skip(reason="slow tier: run with --slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
