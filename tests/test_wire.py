"""The payload codecs (ftrun.wire), in-process: what the worker writes is what the supervisor reads."""

from __future__ import annotations

import pytest

from ftrun.wire import NO_PROGRESS, UNKNOWN_FAILURE, FirstFailure, InfoReport, ProgressReport, WorkerError

pytestmark = pytest.mark.quick


def test_progress_round_trip_keeps_every_field():
    r = ProgressReport(3, 1200, 1700000000.125, 1700000001.5, 4242, 77, 1699999990.25, 1100)
    assert ProgressReport.decode(r.encode()) == r
    assert ProgressReport.decode(r.encode().encode()) == r  # the store hands back bytes


def test_progress_seed_and_short_reports_decode_with_defaults():
    assert ProgressReport.decode(b"-1 0 0 0 0") == NO_PROGRESS
    assert ProgressReport.decode(NO_PROGRESS.encode()) == NO_PROGRESS
    old = ProgressReport.decode("2 10 5.0 6.0 99 4")  # a writer without the goodput fields
    assert old is not None and old.activity == 4 and old.saved_steps == -1 and old.first_step_time == 0.0


@pytest.mark.parametrize("raw", [None, b"", "1 2 3", "x 1 2 3 4", "1 2 nan-ish 3 4", "1 2 3 4 5.5"])
def test_progress_damaged_is_none_never_an_error(raw):
    assert ProgressReport.decode(raw) is None


def test_info_round_trip_and_damage():
    r = InfoReport({"step": 12, "inc": 1, "phase": "train"}, beat=7)
    back = InfoReport.decode(r.encode().encode())
    assert back is not None and dict(back.fields) == dict(r.fields) and back.beat == 7
    assert InfoReport.decode(b"{not json") is None and InfoReport.decode(b"[1, 2]") is None
    assert InfoReport.decode(b"") is None


def test_worker_error_reads_what_torchs_record_writes(tmp_path, monkeypatch):
    """TORCHELASTIC_ERROR_FILE as torch elastic's own ErrorHandler (behind @record) writes it."""
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def inner():
        raise ValueError("bad batch shape")

    try:
        inner()
    except ValueError as e:
        ErrorHandler().record_exception(e)
    err = WorkerError.decode(path.read_bytes())
    assert err is not None and err.message == "ValueError: bad batch shape"
    assert err.where.startswith('File "') and "in inner" in err.where and err.timestamp > 0
    assert WorkerError.decode(err.encode()) == err
    assert WorkerError.decode(b'{"message": "RuntimeError: plain\\nmore"}') == WorkerError("RuntimeError: plain")
    for damaged in (b"", b"{", b"[]", b'{"message": 3}', b'{"message": {"message": ""}}'):
        assert WorkerError.decode(damaged) is None


def test_first_failure_round_trip_and_damage_is_an_unknown_failure():
    f = FirstFailure(node=2, rank=9, reason="exited 1 with a traceback: ValueError: x", code=1,
                     signature="ValueError: x | File \"t.py\", line 3, in main")
    assert FirstFailure.decode(f.encode().encode()) == f
    assert FirstFailure.decode('{"node": 1, "rank": 3}') == FirstFailure(1, 3)
    for damaged in (b"", b"{", b"[]", b'{"rank": 1}', b'{"node": "a", "rank": 1}'):
        assert FirstFailure.decode(damaged) == UNKNOWN_FAILURE
