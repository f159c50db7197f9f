"""Execution of the engine's steps across processes: the tensor-parallel runner.

``tensor_parallel.TensorParallelRunner`` is a ``worker.base.ModelRunner`` like any other:
the step loop hands it a ``SchedulerOutput`` and never learns that N ranks ran it.
``collectives`` holds how ranks join a group and gather (gloo, NCCL), ``shm_collective``
the shared-memory all-gather for ranks on one CPU machine.
"""
