"""Connectors: where records enter and leave a dataflow. One concept per module, no cycles:

- :mod:`.sources`: the source API (:class:`Source`, :class:`SourceReader`, ``END``) and
  :class:`GeneratorSource`;
- :mod:`.sinks`: the sink API (:class:`Sink`, :class:`SinkWriter`, :class:`SinkRollback`) and
  :class:`CollectSink`;
- :mod:`.fs`: the file-system helpers and the store contract the file connectors and the
  batch log write through;
- :mod:`.file_source`: :class:`FileSource`; :mod:`.file_sink`: :class:`FileSink` and
  :func:`read_output`;
- :mod:`.batchlog`: the replayable batch log (no Spark);
- :mod:`.spark_arrow`, :mod:`.spark_stream`, :mod:`.spark_microbatch`: the Spark adapters,
  the only modules that import pyspark (inside functions: importing them needs no pyspark;
  building a Spark source without it raises :class:`abs.errors.MissingExtraError`).

Import order: ``sources``/``sinks`` <- ``fs`` <- ``file_*``, ``batchlog`` <- ``spark_*``.
This package imports none of its modules itself.
"""
