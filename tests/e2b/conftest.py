"""Shared by the SDK suites. Against the nested machine (tests/e2b/run_nested.sh sets
CLADE_NESTED_MACHINE_PID, the process running it): once that machine has ended, every test
left would only wait for its requests to time out, so the session stops there."""

import os

import pytest


def _machine_ended():
    pid = os.environ.get("CLADE_NESTED_MACHINE_PID")
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


@pytest.fixture(autouse=True)
def _stop_when_the_nested_machine_ended():
    if _machine_ended():
        pytest.exit("the nested machine has ended: no test left can reach it", returncode=1)
    yield
