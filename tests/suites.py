#!/usr/bin/env python3
"""The suite log's summary, and CI's check of it against tests/must-run.txt.

The log (CUBE_SUITE_LOG, written by tests/testkit's gates, tests/cube_suite_log.py and
tests/nested/run.sh) has one line per outcome:

    RAN     <label> <test>            the test ran to its end
    XFAIL   <label> <test>: <why>     it failed as expected (a known gap, pytest's strict xfail)
    SKIPPED <label> <test>: <why>     it was skipped (by its gate, or after it)
    FAILED  <label> <test>: <why>     it failed (or its gate refused under CUBE_REQUIRE_*)

A test is RAN only when every line about it says RAN (a test gated on root and KVM writes two).
The list names one test per line; `xfail: <test>` is one that must fail as expected.

    suites.py summary LOG             print the summary
    suites.py check LOG LIST          print it, then fail unless every test in LIST ran, none was
                                      skipped or failed, and none ran that LIST does not name
    suites.py write LOG LIST          write the tests that ran to LIST (after a full, green run)
"""

import sys
from collections import defaultdict

STATES = ("RAN", "XFAIL", "SKIPPED", "FAILED")


def parse(path):
    """{test: (state, labels, reasons)}: FAILED beats SKIPPED beats XFAIL beats RAN."""
    seen = defaultdict(lambda: [set(), set(), []])
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except FileNotFoundError:
        lines = []
    for n, line in enumerate(lines, 1):
        state, _, rest = line.partition(" ")
        rest = rest.lstrip(" ")
        label, _, rest = rest.partition(" ")
        if state not in STATES or not rest:
            raise SystemExit(f"suites.py: {path}:{n}: not a suite log line: {line!r}")
        test, why = (rest, "") if state == "RAN" else (rest.partition(": ")[0], rest.partition(": ")[2])
        s = seen[test]
        s[0].add(state)
        s[1].add(label)
        if why:
            s[2].append(why)
    out = {}
    for test, (states, labels, why) in seen.items():
        state = next(s for s in reversed(STATES) if s in states)
        out[test] = (state, "+".join(sorted(labels)), why)
    return out


def read_list(path):
    """{test: the state it must end in}."""
    want = {}
    for line in open(path, encoding="utf-8").read().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            if line.startswith("xfail: "):
                want[line[len("xfail: "):]] = "XFAIL"
            else:
                want[line] = "RAN"
    return want


def summary(tests):
    by_label = defaultdict(lambda: defaultdict(int))
    for state, label, _ in tests.values():
        by_label[label][state] += 1
    print(f"{'needs':<16} {'ran':>5} {'xfail':>6} {'skipped':>8} {'failed':>7}")
    for label in sorted(by_label):
        c = by_label[label]
        print(f"{label:<16} {c['RAN']:>5} {c['XFAIL']:>6} {c['SKIPPED']:>8} {c['FAILED']:>7}")
    total = defaultdict(int)
    for state, _, _ in tests.values():
        total[state] += 1
    print(f"{'all':<16} {total['RAN']:>5} {total['XFAIL']:>6} {total['SKIPPED']:>8} {total['FAILED']:>7}")
    for want in ("XFAIL", "SKIPPED", "FAILED"):
        for test in sorted(t for t, v in tests.items() if v[0] == want):
            why = "; ".join(dict.fromkeys(tests[test][2])) or "-"
            print(f"{want:<8} {tests[test][1]} {test}: {why}")


def main(argv):
    if len(argv) < 2 or argv[0] not in ("summary", "check", "write"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    tests = parse(argv[1])
    if argv[0] == "write":
        if len(argv) != 3:
            return main([])
        ran = sorted(t for t, v in tests.items() if v[0] == "RAN")
        ran += sorted(f"xfail: {t}" for t, v in tests.items() if v[0] == "XFAIL")
        with open(argv[2], "w", encoding="utf-8") as f:
            f.write("# Privileged, KVM, PostgreSQL, nested and Python tests that must run to their end\n"
                    "# under CI (CUBE_REQUIRE_PRIV=1 CUBE_REQUIRE_KVM=1); tests/suites.py checks the suite\n"
                    "# log against it. Regenerate after a green run: tests/suites.py write LOG this-file.\n")
            f.writelines(t + "\n" for t in ran)
        print(f"suites.py: wrote {len(ran)} tests to {argv[2]}")
        return 0
    summary(tests)
    if argv[0] == "summary":
        return 0
    if len(argv) != 3:
        return main([])
    listed = read_list(argv[2])
    bad = 0
    for t, want in listed.items():
        if t not in tests:
            print(f"MISSING  {t}: listed in {argv[2]}, did not report")
            bad += 1
        elif tests[t][0] != want:
            if tests[t][0] in ("RAN", "XFAIL"):
                print(f"CHANGED  {t}: {tests[t][0]}, listed as {want} (update {argv[2]})")
            bad += 1
    extra = sorted(set(tests) - set(listed))
    for t in extra:
        print(f"UNLISTED {t}: {tests[t][0]}, not in {argv[2]} (add it, or find why it ran)")
    bad += len(extra)
    if bad:
        print(f"suites.py: {len(listed)} listed; check FAILED ({bad} problem(s) above)")
        return 1
    xfail = sum(1 for w in listed.values() if w == "XFAIL")
    print(f"suites.py: all {len(listed)} listed tests ran to their end ({xfail} failing as expected)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
