"""bench/weight_push.py at its --quick size: every path and its raw limit run in each round, the ratios follow from
the GB/s it reports, the server measured every swap, and the PNG is written."""

from __future__ import annotations

import json
import statistics

import pytest

from bench import weight_push


def test_quick_run_pairs_every_path_with_its_raw_limit(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    png = tmp_path / "push.png"
    assert weight_push.main(["--quick", "--dtypes", "bfloat16", "--rounds", "2", "--streams", "2",
                             "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "weight_push" and len(out["loadavg"]) == 4 and out["png"] == str(png)
    assert png.stat().st_size > 0
    [cfg] = out["configs"]
    assert cfg["dtype"] == "bfloat16" and cfg["checksum"] == "xxh3_128" and cfg["bytes"] > 2**20
    assert set(cfg["paths"]) == set(weight_push.PATHS)
    for path in cfg["paths"].values():
        assert len(path["gb_s"]) == len(path["raw_gb_s"]) == 2
        runs = [ours / raw for ours, raw in zip(path["gb_s"], path["raw_gb_s"], strict=True)]
        assert path["ratio_to_raw"]["runs"] == pytest.approx(runs, rel=0.02, abs=1e-3)  # written to 3 decimals
        assert path["ratio_to_raw"]["median"] == pytest.approx(statistics.median(runs), rel=0.02, abs=1e-3)
    for name in ("grpc", "http", "disk", "shm", "memfd"):
        assert cfg["paths"][name]["swap_ms_median"] is not None  # the server reported each swap
    assert cfg["pause"]["swap_ms"] >= 0 and cfg["pause"]["max_gap_around_swap_ms"] > 0


def test_rounds_must_be_positive() -> None:
    with pytest.raises(SystemExit):
        weight_push.main(["--rounds", "0"])
