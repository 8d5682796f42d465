"""`python -m dtf.data.prepare --format petastorm` as a user runs it: the data sets are built in
dtf's environment and written by Petastorm in its side environment (dtf.sideenv), and Petastorm's
own reader reads back exactly the arrays dtf builds in memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dtf.data.prepare import build_splits
from tests.helpers.run_command import dtf_command, run_command
from tests.helpers.side_venv import side_python
from tests.helpers.user_datasets import petastorm_reads

SETTINGS = ["--set", "num_points=1200", "--set", "num_test=200"]
PREPARE = dtf_command(
    "scalar_field", "--format", "petastorm", "--rows-per-group", "250", *SETTINGS, module="dtf.data.prepare"
)


def test_petastorms_reader_reads_back_the_data_set_dtf_builds(tmp_path: Path) -> None:
    python = side_python("petastorm")
    made = run_command(dtf_command("petastorm", module="dtf.sideenv"))
    assert made.stdout.strip() == str(python), made.stderr  # made already: found at once
    proc = run_command([*PREPARE, "--out", str(tmp_path)], timeout=300, cwd=tmp_path)
    assert f"{tmp_path}/scalar_field/petastorm/train: 1000 rows, features [2] float32, label float32" in proc.stdout
    for split, (x, y) in build_splits("scalar_field", SETTINGS[1::2]).items():
        directory = tmp_path / "scalar_field" / "petastorm" / split
        assert (directory / "_common_metadata").is_file()  # the Unischema, as materialize_dataset leaves it
        # One Spark partition per row group, each its own file of about --rows-per-group rows
        files = sorted(directory.glob("*.parquet"))
        assert [pq.ParquetFile(f).metadata.num_row_groups for f in files] == [1] * -(-len(x) // 250)
        read = petastorm_reads(directory, batch_reader=False)  # make_reader: rows decoded by the codecs
        assert read["features"].dtype == x.dtype and read["label"].dtype == y.dtype
        np.testing.assert_array_equal(read["features"], x, strict=True)  # the same rows, in the same order
        np.testing.assert_array_equal(read["label"], y, strict=True)
