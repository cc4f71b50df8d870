"""Consistent, incremental, rescalable snapshots for Python dataflows.

Public API::

    import abs
    flow = abs.Dataflow("counts")
    ...
    result = abs.run(flow, parallelism=3, checkpoint=abs.CheckpointConfig(interval=1.0), storage="./snapshots")
"""
from abscore.lazy import lazy_names as _lazy_names
from abscore.logs import package_logger as _package_logger

_package_logger("abs")  # warnings and notices reach stderr unless the application routes logging itself

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use (below)
    from .api import JobHandle, run, submit
    from .autoscale import Autoscale
    from .config import CheckpointConfig, RestartStrategy
    from .connectors.file_sink import FileSink, read_output
    from .connectors.file_source import FileSource
    from .connectors.sinks import CollectSink, Sink, SinkRollback, SinkWriter
    from .connectors.sources import END, GeneratorSource, Source, SourceReader
    from .connectors.spark_microbatch import SparkMicroBatchSource
    from .connectors.spark_stream import SparkStreamSource
    from .dataflow import Dataflow, KeyedStream, Stream
    from .errors import (AbsError, CheckpointFailedError, ConfigError, DuplicateUidError, GraphError,
                         JobFailedError, OperatorError, ParallelismError, ReconfigurationError,
                         RepeatedOutputError, StartupError, WorkerLostError)
    from .options import Restore, RuntimeOptions
    from .runtime.executors import LocalExecutor
    from .runtime.results import CheckpointStats, JobResult
    from .runtime.spark import SparkExecutor
    from .state import ListState, MapState, ReducingState, ValueState

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


_HOMES = {
    ".api": ("JobHandle", "run", "submit"),
    ".autoscale": ("Autoscale",),
    ".config": ("CheckpointConfig", "RestartStrategy"),
    ".options": ("Restore", "RuntimeOptions"),
    ".dataflow": ("Dataflow", "KeyedStream", "Stream"),
    ".errors": ("AbsError", "ConfigError", "DuplicateUidError", "GraphError", "JobFailedError", "OperatorError",
                "StartupError", "CheckpointFailedError", "WorkerLostError", "ParallelismError",
                "ReconfigurationError", "RepeatedOutputError"),
    ".runtime.results": ("CheckpointStats", "JobResult"),
    ".runtime.executors": ("LocalExecutor",),
    ".runtime.spark": ("SparkExecutor",),  # pyspark is an extra
    ".connectors.file_sink": ("FileSink", "read_output"),
    ".connectors.file_source": ("FileSource",),
    ".connectors.sinks": ("CollectSink", "Sink", "SinkWriter", "SinkRollback"),
    ".connectors.sources": ("END", "GeneratorSource", "Source", "SourceReader"),
    ".connectors.spark_stream": ("SparkStreamSource",),
    ".connectors.spark_microbatch": ("SparkMicroBatchSource",),
    ".state": ("ListState", "MapState", "ReducingState", "ValueState"),
}
# the public names load on first use: a worker process imports abs.runtime.worker_main, which
# runs this package's __init__ first, and needs neither the driver nor the connectors it does
# not use (importing them all took ~0.4 s of every worker's start-up)
__getattr__, __dir__ = _lazy_names(__name__, globals(), _HOMES)
