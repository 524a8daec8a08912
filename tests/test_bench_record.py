"""Benchmark records land in the checkout they are run from, whatever copy of the package runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superinfer.workload import record
from superinfer.workload.record import results_dir, write_result


def test_a_checkout_root_gets_the_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SUPERINFER_RESULTS_DIR", raising=False)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    path = write_result("unit", "cpu", {"x": 1.0}, {"x": ">= 1"}, tag="t")
    assert path.parent == tmp_path / "bench" / "results"
    record = json.loads(path.read_text())
    assert record["figures"] == {"x": 1.0} and record["device"] == "cpu" and path.name.startswith("unit-t-cpu-")


def test_the_variable_wins_and_elsewhere_the_package_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no bench/results here
    monkeypatch.delenv("SUPERINFER_RESULTS_DIR", raising=False)
    assert results_dir() == Path(record.__file__).parent.parent / "bench" / "results"
    monkeypatch.setenv("SUPERINFER_RESULTS_DIR", "out")
    assert results_dir() == tmp_path / "out"


def test_paths_among_a_records_settings_are_written_as_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer bench's trace load keeps its trace as a Path: a 35-minute run had failed at the end
    writing its record."""
    monkeypatch.setenv("SUPERINFER_RESULTS_DIR", str(tmp_path))
    path = write_result("unit", "cpu", {}, {}, extra={"loads": {"trace": {"path": tmp_path / "t.csv"}}})
    assert json.loads(path.read_text())["loads"]["trace"]["path"] == str(tmp_path / "t.csv")
