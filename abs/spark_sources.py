"""The Spark sources under the import path the README shows (``abs.spark_sources.X``).

They live in :mod:`abs.connectors.spark_stream` and :mod:`abs.connectors.spark_microbatch`;
this module only re-exports them (no class path of it is stored on disk).
"""
from .connectors.batchlog import SparkSourceError
from .connectors.spark_microbatch import SparkMicroBatchSource
from .connectors.spark_stream import SparkStreamSource

__all__ = ["SparkStreamSource", "SparkMicroBatchSource", "SparkSourceError"]
