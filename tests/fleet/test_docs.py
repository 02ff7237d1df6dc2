"""The commands the docs tell an operator to run run as written: every script in git that has a
shebang is executable (a user runs it directly, as the docs do), every `deploy/install.sh` line
in the README and docs/ is accepted by install.sh (`--check`: arguments validated, nothing
installed), every `cubectl` line names real subcommands and flags, and every `bash FILE` names a
file that exists. test_fleet.py installs a fleet with the install commands of docs/install.md
(doc_commands.py), so their flags are exercised for real too."""

import os
import re
import subprocess

import pytest

from doc_commands import DOCS, REPO, commands


def test_scripts_with_a_shebang_are_executable_in_git():
    r = subprocess.run(["git", "-C", REPO, "ls-files", "-s"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"git ls-files in {REPO}: {r.stderr.strip()} (the check needs the git checkout)")
    not_exec = []
    for line in r.stdout.splitlines():
        meta, path = line.split("\t", 1)
        mode = meta.split()[0]
        full = os.path.join(REPO, path)
        if mode != "100644" or not os.path.isfile(full):
            continue
        with open(full, "rb") as f:
            # "#!/": a Rust inner attribute (`#![...]`) is not a shebang.
            if f.read(3) in (b"#!/", b"#! "):
                not_exec.append(path)
    assert not not_exec, "scripts with a shebang but no execute bit in git " \
                         f"(git update-index --chmod=+x): {not_exec}"


def test_documented_install_commands_are_accepted_as_written():
    found = [c for c in commands() if c.argv[0] == "deploy/install.sh"]
    assert len(found) >= 4, f"the docs lost their install commands: {found}"
    for c in found:
        # Run as the docs write it: the path relative to the checkout, executed directly.
        r = subprocess.run(c.argv + ["--check"], cwd=REPO, capture_output=True, text=True)
        assert r.returncode == 0 and "arguments OK" in r.stdout, \
            f"{c.where}: `{c.text}` is refused: {r.stdout}{r.stderr}"


def cubectl():
    tgt = os.environ.get("CARGO_TARGET_DIR")
    if not tgt:
        pytest.fail("CARGO_TARGET_DIR must point at the cargo target dir with the debug binaries")
    exe = os.path.join(tgt, "debug", "cubectl")
    if not os.path.exists(exe):
        pytest.fail(f"{exe} missing: cargo build -p cubectl")
    return exe


def test_documented_cubectl_commands_parse():
    exe = cubectl()
    found = [c for c in commands() if c.argv[0] == "cubectl"]
    assert len(found) >= 8, f"the docs lost their cubectl commands: {found}"
    for c in found:
        # `--help` after the documented arguments: clap rejects an unknown subcommand or flag
        # before it gets there, and prints help (exit 0) for a valid line without running it.
        r = subprocess.run([exe, *c.argv[1:], "--help"], capture_output=True, text=True)
        assert r.returncode == 0, f"{c.where}: `{c.text}`: {r.stderr.strip()}"


def test_documented_files_exist():
    found = [c for c in commands() if c.argv[0] == "bash"]
    assert found, "no `bash FILE` lines found"
    for c in found:
        path = os.path.join(REPO, c.argv[1])
        assert os.path.isfile(path), f"{c.where}: `{c.text}`: {c.argv[1]} does not exist"


def test_the_docs_are_found():
    # The extraction itself: every doc is read, and a known line comes out whole.
    assert os.path.join(REPO, "docs", "install.md") in DOCS
    texts = [c.text for c in commands()]
    assert any(re.fullmatch(r"deploy/install\.sh --compute --master \S+ --join-token TOKEN "
                            r"--advertise \S+ --tls-ca ca\.pem --tls-cert node7\.pem "
                            r"--tls-key node7\.key --bin-dir /opt/cube/bin", t) for t in texts), texts
