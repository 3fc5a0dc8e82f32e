"""The payload codecs (ftrun.wire), in-process: what the worker writes is what the supervisor reads."""

from __future__ import annotations

import json

import pytest

from ftrun.wire import (NO_PROGRESS, NO_REPORT, UNKNOWN_FAILURE, WIRE_VERSION, FirstFailure, MemberReport,
                        ProgressReport, SurvivorReport, WorkerError)

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


def test_member_report_round_trip_keeps_every_field():
    r = MemberReport(inc=2, quorum_id=5, replicas=3, in_quorum=True, healing=False, step=120, round=40, committed=38,
                     discarded=2, last_heal_s=0.125, phase="vote", phase_since=1700000000.5, heals=1,
                     last_transfer={"bytes": 1024, "s": 0.1}, beat=7)
    assert MemberReport.decode(r.encode()) == r
    assert MemberReport.decode(r.encode().encode()) == r  # the store hands back bytes
    assert MemberReport.from_object(json.loads(r.encode())) == r  # a node relays the parsed object
    assert json.loads(r.encode())["version"] == WIRE_VERSION


@pytest.mark.parametrize("raw", [None, b"", b"{not json", b"[1, 2]", b"3", b'"text"', b"null"])
def test_member_report_garbage_is_none_never_an_error(raw):
    assert MemberReport.decode(raw) is None


def test_member_report_wrong_types_read_as_defaults():
    obj = {"version": WIRE_VERSION, "inc": "1", "quorum_id": 2.5, "replicas": None, "in_quorum": 1, "healing": "yes",
           "step": True, "round": [3], "discarded": {}, "last_heal_s": "0.5", "phase": 7, "phase_since": False,
           "last_transfer": [1], "beat": 1.5, "unknown": 1}
    assert MemberReport.from_object(obj) == NO_REPORT
    assert MemberReport.from_object({"version": WIRE_VERSION, "inc": 3, "step": 9}) == MemberReport(inc=3, step=9)
    assert MemberReport.decode(json.dumps({"version": WIRE_VERSION, "last_heal_s": 2})).last_heal_s == 2.0


@pytest.mark.parametrize("version", [None, 1, WIRE_VERSION + 1, "2"])
def test_a_member_report_of_another_version_reads_as_that_version_alone(version):
    obj = {"inc": 1, "quorum_id": 4, "epoch": 4, "round": 9, "phase": "vote", "step": 30}
    if version is not None:
        obj["version"] = version
    r = MemberReport.decode(json.dumps(obj))
    assert r is not None and r.version != WIRE_VERSION
    assert r == MemberReport(version=r.version)  # nothing else of it is read
    assert r.version == (version if isinstance(version, int) else 0)


def test_survivor_report_round_trip_and_damage():
    r = SurvivorReport(inc=1, step=12, in_sync=True, decided=True, latest=7, sub_steps=2)
    assert SurvivorReport.decode(r.encode()) == r and SurvivorReport.decode(r.encode().encode()) == r
    for damaged in (None, b"", b"{", b"[]", b"5"):
        assert SurvivorReport.decode(damaged) is None
    old = {"inc": 1, "step": 12, "in_sync": True, "decided": True, "latest": 7}  # another ftrun's: no version
    assert SurvivorReport.decode(json.dumps(old)) is None
    assert SurvivorReport.decode(json.dumps({"version": WIRE_VERSION, "step": "x", "in_sync": 1})) == SurvivorReport()


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
