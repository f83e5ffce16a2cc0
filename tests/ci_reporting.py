"""A pytest plugin for CI runs (`CI` set): each failure is printed the moment it happens, with the disk's free
space, the load average and the number of threads in pytest.

A CI run killed at its time limit prints no summary; one such run left nothing in its log but a row of E and F, so
neither the errors nor what the machine was short of could be read. conftest.py loads this plugin; the test of it
runs pytest with `-p ci_reporting`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import pytest

TAIL_LINES = 40  # of a failure's report


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


class FailuresAsTheyHappen:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if not report.failed or terminal is None:
            return
        free = ", ".join(f"{path}: {shutil.disk_usage(path).free / 2**30:.1f} GiB free"
                         for path in dict.fromkeys((os.getcwd(), tempfile.gettempdir())))
        load = "/".join(f"{x:.1f}" for x in os.getloadavg())
        terminal.write_line("")
        terminal.write_line(f"!!! {report.when} of {report.nodeid} failed after {report.duration:.1f} s ({free}; "
                            f"load {load}; {threading.active_count()} threads in pytest)", red=True)
        for line in report.longreprtext.splitlines()[-TAIL_LINES:]:
            terminal.write_line(f"    {line}")


def pytest_configure(config: pytest.Config) -> None:
    if in_ci() and not config.pluginmanager.has_plugin("failures-as-they-happen"):
        config.pluginmanager.register(FailuresAsTheyHappen(config), "failures-as-they-happen")
