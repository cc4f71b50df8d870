"""Consistent, incremental, rescalable snapshots for Python dataflows.

Public API::

    import abs
    flow = abs.Dataflow("counts")
    ...
    result = abs.run(flow, parallelism=3, checkpoint=abs.CheckpointConfig(interval=1.0), storage="./snapshots")
"""
from abscore.logs import package_logger as _package_logger

_package_logger("abs")  # warnings and notices reach stderr unless the application routes logging itself

from .api import JobHandle, run, submit
from .autoscale import Autoscale
from .config import CheckpointConfig, RestartStrategy
from .options import Restore, RuntimeOptions
from .dataflow import Dataflow, KeyedStream, Stream
from .errors import (
    AbsError,
    ConfigError,
    DuplicateUidError,
    GraphError,
    JobFailedError,
    OperatorError,
    StartupError,
    CheckpointFailedError,
    WorkerLostError,
)
from .runtime.driver import CheckpointStats, JobResult, LocalExecutor
from .connectors.file_sink import FileSink, read_output
from .connectors.file_source import FileSource
from .connectors.sinks import CollectSink, Sink, SinkWriter
from .connectors.sources import END, GeneratorSource, Source, SourceReader
from .state import ListState, MapState, ReducingState, ValueState
from .errors import ParallelismError, ReconfigurationError, RepeatedOutputError
from .connectors.sinks import SinkRollback

__all__ = [
    "Dataflow",
    "Stream",
    "KeyedStream",
    "run",
    "submit",
    "JobHandle",
    "JobResult",
    "CheckpointStats",
    "CheckpointConfig",
    "RestartStrategy",
    "Restore",
    "RuntimeOptions",
    "Autoscale",
    "SparkExecutor",
    "SparkStreamSource",
    "SparkMicroBatchSource",
    "LocalExecutor",
    "ValueState",
    "ListState",
    "MapState",
    "ReducingState",
    "Source",
    "SourceReader",
    "END",
    "GeneratorSource",
    "Sink",
    "SinkWriter",
    "CollectSink",
    "FileSink",
    "FileSource",
    "read_output",
    "AbsError",
    "ConfigError",
    "GraphError",
    "DuplicateUidError",
    "JobFailedError",
    "OperatorError",
    "StartupError",
    "CheckpointFailedError",
    "WorkerLostError",
    "RepeatedOutputError",
    "ParallelismError",
    "ReconfigurationError",
    "SinkRollback",
]
__version__ = "0.1.0"


def __getattr__(name: str):  # the Spark pieces load on first use (pyspark is an extra)
    if name == "SparkExecutor":
        from .runtime.spark import SparkExecutor

        return SparkExecutor
    if name == "SparkStreamSource":
        from .connectors.spark_stream import SparkStreamSource

        return SparkStreamSource
    if name == "SparkMicroBatchSource":
        from .connectors.spark_microbatch import SparkMicroBatchSource

        return SparkMicroBatchSource
    raise AttributeError(f"module 'abs' has no attribute {name!r}")
