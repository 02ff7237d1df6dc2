"""pytest plugin (tests/run.sh loads it with `-p cube_suite_log`): appends every test's outcome to
the file named by CUBE_SUITE_LOG, in the Rust gates' format, so tests/suites.py can check that each
listed test ran to its end and none was skipped.

A test is `py <suite>/<nodeid>`, with ` @<runtime>` when CUBE_E2E_RUNTIME picks one (the gvisor
passes run the same files again)."""

import os

_suite = None


def pytest_configure(config):
    global _suite
    _suite = config.rootpath.name


def name_of(suite, nodeid, runtime):
    n = f"{suite}/{nodeid}"
    return f"{n} @{runtime}" if runtime else n


def _log(line):
    path = os.environ.get("CUBE_SUITE_LOG")
    if path:
        # One write per line: suites never run side by side, but keep lines whole regardless.
        with open(path, "a") as f:
            f.write(line + "\n")


def pytest_runtest_logreport(report):
    name = name_of(_suite, report.nodeid, os.environ.get("CUBE_E2E_RUNTIME", ""))
    if hasattr(report, "wasxfail") and report.skipped:
        # An expected failure (a known gap, `xfail(strict=True)` with its issue): its own state,
        # which tests/must-run.txt has to expect by name. One that passes is a failure (strict).
        _log(f"XFAIL   py {name}: {(report.wasxfail or 'xfail').splitlines()[0]}")
    elif report.skipped:
        # longrepr is (file, line, "Skipped: why") for a skip.
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _log(f"SKIPPED py {name}: {why.splitlines()[0] if why else 'skipped'}")
    elif report.failed:
        _log(f"FAILED  py {name}: failed in {report.when}")
    elif report.when == "call":
        _log(f"RAN     py {name}")
