"""scripts/test.sh (what .ci/run runs) checks the free disk before it installs anything: on a disk too full for
its installs it says so and stops, instead of failing inside a pip install (as a CI run on a full disk did)."""

from __future__ import annotations

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
