"""scripts/test.sh (what .ci/run runs) checks the free disk before it installs anything: on a disk too full for
its installs it says so and stops, instead of failing inside a pip install (as a CI run on a full disk did)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GB_IN_KB = 1024 * 1024


def run_script(tmp_path: Path, free_kb: int) -> subprocess.CompletedProcess:
    """The script from a copy of the repository root holding nothing else (no .venv-vllm: the full install), with
    `df` reporting `free_kb` and `python3` a stand-in that records that the installs began and stops there."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stubs = {
        "df": "echo 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
              f"echo '/dev/x 1000000000 1 {free_kb} 1% /'\n",
        "python3": f"echo installing >> {tmp_path / 'installs'}\nexit 3\n",
    }
    for name, body in stubs.items():
        (bindir / name).write_text("#!/bin/sh\n" + body)
        (bindir / name).chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run(["bash", str(repo / "scripts" / "test.sh")], env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_disk_too_full_for_the_installs_stops_the_script_before_them(tmp_path):
    proc = run_script(tmp_path, 3 * GB_IN_KB)
    assert proc.returncode == 1, proc.stderr
    assert "3 GB free on this disk; the installs and tests need about 4 GB" in proc.stderr
    assert not (tmp_path / "installs").exists()


@pytest.mark.parametrize("free_gb", [4, 50])
def test_with_room_enough_the_installs_begin(tmp_path, free_gb):
    proc = run_script(tmp_path, free_gb * GB_IN_KB)
    assert proc.returncode == 3, proc.stderr  # the stand-in python3's exit: the first install ran
    assert (tmp_path / "installs").read_text().startswith("installing")
    assert "GB free on this disk" not in proc.stderr


def test_a_hung_pytest_run_is_stopped_at_its_limit_and_the_other_still_runs(tmp_path):
    """Both pytest runs hang: each is interrupted at its own limit (SIGINT, so pytest can print its summary), the
    second still runs after the first, and the script fails."""
    repo = tmp_path / "repo"
    for sub in ("scripts", "bench", ".venv-vllm/bin"):
        (repo / sub).mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    (repo / "bench" / "setup_vllm_venv.sh").write_text("exit 0\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = f'echo "$*" >> {tmp_path / "interrupted"}'
    hung_pytest = f'case "$*" in *pytest*) sleep 60 & trap \'{record}; kill $!; exit 2\' INT; wait;; esac\nexit 0\n'
    plenty = "echo 'Filesystem 1024-blocks Used Available'\necho '/dev/x 1 1 99999999999'\n"
    stubs = {"python3": hung_pytest, "docker": "exit 0\n", "df": plenty}
    stubs |= {name: "exit 0\n" for name in ("redis-server", "prometheus", "promtool", "dockerd", "docker-compose",
                                            "debootstrap")}
    for name, body in stubs.items():
        (bindir / name).write_text("#!/bin/sh\n" + body)
        (bindir / name).chmod(0o755)
    (repo / ".venv-vllm" / "bin" / "python").symlink_to(bindir / "python3")
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path), "SPECROLL_TEST_LIMIT_S": "2",
           "SPECROLL_VLLM_TEST_LIMIT_S": "3"}
    proc = subprocess.run(["bash", str(repo / "scripts" / "test.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 124, proc.stdout + proc.stderr
    assert "stopped at its time limit of 2 s" in proc.stderr and "stopped at its time limit of 3 s" in proc.stderr
    interrupted = (tmp_path / "interrupted").read_text().splitlines()
    assert len(interrupted) == 2 and "--ignore=tests/vllm" in interrupted[0] and "tests/vllm" in interrupted[1]


def test_in_ci_each_failure_is_printed_when_it_happens(tmp_path):
    """The ci_reporting plugin prints a failure's report (and the free disk) before the run goes on, not only in
    the summary at the end that a run killed at its limit never prints; outside CI it prints nothing extra."""
    (tmp_path / "test_two.py").write_text("def test_fails():\n    assert 1 + 1 == 3, 'arithmetic is broken'\n\n\n"
                                          "def test_after():\n    print('SECOND RAN')\n")
    command = ["python3", "-m", "pytest", "-p", "ci_reporting", "-p", "no:cacheprovider", "-s", "-q", "-o",
               "addopts=", "--rootdir", str(tmp_path), str(tmp_path)]
    base = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(ROOT / "tests")}
    in_ci = subprocess.run(command, env=base | {"CI": "true"}, capture_output=True, text=True, timeout=120).stdout
    assert "!!! call of test_two.py::test_fails failed after" in in_ci and "GiB free" in in_ci
    report = in_ci.index("!!! call of test_two.py::test_fails")
    assert report < in_ci.index("arithmetic is broken") < in_ci.index("SECOND RAN"), in_ci
    local = subprocess.run(command, env=base, capture_output=True, text=True, timeout=120).stdout
    assert "!!!" not in local and "SECOND RAN" in local
