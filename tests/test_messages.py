"""The typed messages between driver, workers, tasks, uploaders and writer processes."""
from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import queue

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.runtime import messages as m
from abs.runtime.driver import JobDriver, _Attempt
from abs.runtime.worker import Worker, WorkerSpec
from abs.runtime.writer import FrameReader, send_frame
from storage.manifest import FileRef
from storage.paths import StoragePaths

REF = FileRef(path=StoragePaths.state_file(1, "count", "n", 3, "base"), checkpoint_id=1, kind="base", bytes=10, rows=2, checksum="0" * 64)

# one instance of every message class, with values of the kinds each one carries
SAMPLES = {
    m.WorkerAssignment: m.WorkerAssignment(2, {"src": {"s0": 5}}, {"count": {"n": {3: [REF]}}}, {"out": ["t"]}),
    m.Hello: m.Hello(1, 4242),
    m.Heartbeat: m.Heartbeat(1),
    m.JobSpec: m.JobSpec(b"payload", m.WorkerAssignment(0, {})),
    m.Listening: m.Listening(("127.0.0.1", 5000)),
    m.Peers: m.Peers((("127.0.0.1", 5000), ("127.0.0.1", 5001))),
    m.RestoreStats: m.RestoreStats(10, 0.5, {"count": {"n": (1, 2)}}),
    m.Ready: m.Ready(m.RestoreStats()),
    m.Start: m.Start(),
    m.TriggerCheckpoint: m.TriggerCheckpoint(7, 6),
    m.CheckpointAborted: m.CheckpointAborted(7, "timeout"),
    m.CheckpointCompleted: m.CheckpointCompleted(7),
    m.Resume: m.Resume(7),
    m.Finish: m.Finish(),
    m.Stop: m.Stop(),
    m.Shutdown: m.Shutdown(),
    m.TaskAck: m.TaskAck({"count": {"n": {3: [REF]}}}, {"src": {"s0": 5}}, {"out": {"0": "t"}}, 10, 1, 0.1, 0.2, 0.3, 0.4,
                          times=(1.0, 1.1, 1.2)),
    m.Ack: m.Ack(7, "task1#0", m.TaskAck({}, {}, {}, 0, 0, 0.0)),
    m.Decline: m.Decline(7, "task1#0", "upload failed"),
    m.SourceExhausted: m.SourceExhausted("task0#0"),
    m.TaskDone: m.TaskDone("task0#0"),
    m.TaskFailed: m.TaskFailed("worker0", "<startup>", "Traceback ...", "connecting", "OSError: x", True),
    m.Collect: m.Collect("out/0/abc/7", "out", [b"batch"]),
    m.CollectCommit: m.CollectCommit(("out/0/abc/7",)),
    m.WorkerMetrics: m.WorkerMetrics({"count": 5}, 10, 20),
    m.Metrics: m.Metrics(0, m.WorkerMetrics({"count": 5})),
    m.Done: m.Done(0, m.WorkerMetrics({})),
    m.WriteJob: m.WriteJob("count", "n", 3, [REF], pa.table({"key": [1], "value": [2]}), True),
    m.WriterOpen: m.WriterOpen("file:///tmp/x", {"anon": True}),
    m.WriteSnapshot: m.WriteSnapshot(7, [m.WriteJob("count", "n", 3, [], np.arange(4), False)]),
    m.WriteDone: m.WriteDone([[REF]], 0.25),
    m.WriteFailed: m.WriteFailed("OSError: disk full"),
    m.StartStep: m.StartStep(3, ((1, 0), (2, 1)), 6, 2, "drain", (("src", 2, 0, ("1", "3")),)),
    m.AddPeers: m.AddPeers(2, (("127.0.0.1", 4000),), 3),
    m.PeersAdded: m.PeersAdded(1),
    m.ChannelAdded: m.ChannelAdded(5),
    m.SplitsHandover: m.SplitsHandover(4, "src", 2, 0, {"split-1": 120}),
    m.Preload: m.Preload(3, 6, {"count": {"n": {3: [REF]}}}),
    m.KeyGroupHandover: m.KeyGroupHandover(3, "count", 3, 0, 1, {"n": b"ipc"}, {"n": [REF]}),
    m.KeyGroupInstalled: m.KeyGroupInstalled(3, "count", 3, 1, 10),
}
IN_PROCESS = {m.CheckpointRequest, m.CancelRequest, m.UploadJob, m.ReconfigRequest, m.InstallState}  # never cross a process boundary


def all_message_classes() -> set[type]:
    return {getattr(m, name) for name in m.__all__ if dataclasses.is_dataclass(getattr(m, name))}


def test_every_message_class_has_a_sample_here():
    assert all_message_classes() == set(SAMPLES) | IN_PROCESS


@pytest.mark.parametrize("cls", sorted(all_message_classes(), key=lambda c: c.__name__))
def test_every_message_is_a_frozen_slotted_dataclass(cls):
    params = cls.__dataclass_params__
    assert params.frozen, cls
    assert "__slots__" in cls.__dict__, cls


@pytest.mark.parametrize("cls", sorted(SAMPLES, key=lambda c: c.__name__))
def test_every_message_round_trips_pickle(cls):
    msg = SAMPLES[cls]
    for protocol in (4, 5):
        back = pickle.loads(pickle.dumps(msg, protocol=protocol))
        assert type(back) is cls
        if cls not in (m.WriteJob, m.WriteSnapshot):  # tables and arrays compare by content below
            assert back == msg
    if dataclasses.fields(cls):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, dataclasses.fields(cls)[0].name, None)


def test_writer_messages_round_trip_the_writer_pipe_frames():
    a, b = multiprocessing.Pipe()
    try:
        for msg in (SAMPLES[m.WriterOpen], SAMPLES[m.WriteSnapshot], SAMPLES[m.WriteJob]):
            send_frame(a, msg)
            back = FrameReader().recv(b)
            assert type(back) is type(msg)
        job = SAMPLES[m.WriteSnapshot].jobs[0]
        send_frame(a, m.WriteSnapshot(7, [job]))
        back = FrameReader().recv(b)
        assert back.checkpoint_id == 7 and back.jobs[0].key_group == 3
        assert np.array_equal(back.jobs[0].delta, job.delta)
    finally:
        a.close()
        b.close()


@dataclasses.dataclass(frozen=True)
class Bogus:
    what: str = "from another version"


def tiny_flow() -> abs.Dataflow:
    flow = abs.Dataflow("tiny")
    flow.source("src", abs.GeneratorSource(10, num_keys=2, num_splits=1)).sink("out", abs.CollectSink())
    return flow


def test_a_worker_rejects_an_unknown_control_message_with_a_clear_error():
    flow = tiny_flow()
    spec = WorkerSpec(flow=flow, parallelism=1, routing=(0,) * flow.max_parallelism, checkpointing=False,
                      checkpoint_mode="abs", storage_url=None, storage_options=None)
    worker = Worker(0, None, spec, b"secret")
    assert worker.on_control(m.Shutdown()) is False
    for bad in (Bogus(), ("trigger", 1, 0)):  # the old tuple protocol is unknown too
        with pytest.raises(m.ProtocolError) as info:
            worker.on_control(bad)
        text = str(info.value)
        assert "worker 0" in text and type(bad).__name__ in text and "same version of abs" in text
        assert isinstance(info.value, abs.AbsError)


def test_the_driver_rejects_an_unknown_message_of_a_worker_with_a_clear_error():
    driver = JobDriver(tiny_flow(), parallelism=1, checkpoint=None, storage=None, storage_options=None,
                       restore=None, executor=None)
    here, worker_end = multiprocessing.Pipe()
    try:
        worker_end.send(Bogus())
        with pytest.raises(m.ProtocolError) as info:
            driver._gather({0: here}, m.Listening, procs=[])
        text = str(info.value)
        assert "worker 0" in text and "Bogus" in text and "Listening" in text and "same version of abs" in text
    finally:
        here.close()
        worker_end.close()


def test_the_driver_rejects_an_unknown_request_of_its_handle():
    driver = JobDriver(tiny_flow(), parallelism=1, checkpoint=None, storage=None, storage_options=None,
                       restore=None, executor=None)
    driver.requests.put(("checkpoint", queue.Queue()))
    with pytest.raises(m.ProtocolError, match="JobHandle"):
        driver._serve_requests(_Attempt(procs=[], conns={}, coord=None, life=None, by_conn={}))
