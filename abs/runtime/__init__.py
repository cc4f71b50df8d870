"""The runtime: physical plan, channels, tasks, workers, driver and launchers.

Data plane: every worker hosts subtask ``i`` of every operator; forward edges are chained
in-process; exchanges (key_by, rebalance, broadcast) go over one authenticated TCP
connection per (upstream subtask, downstream subtask) channel, carrying framed Arrow IPC
batches, barriers, cancel markers and end-of-stream, FIFO, with bounded buffers (a full
buffer stops the receiver, TCP stops the sender: backpressure).

Control plane: the driver hosts the checkpoint coordinator and the source split
enumerators, and talks to each worker over one authenticated control connection.
"""
