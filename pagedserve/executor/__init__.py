"""Between the engine core and its workers (vLLM v1's ``executor/``): :func:`create_executor`
gives the core what it runs steps on, the in-process :class:`pagedserve.worker.worker.Worker`
when ``tensor_parallel_size`` is 1, else a :class:`tp_executor.TPExecutor` whose ``execute_model``
is a collective call over ranks started by a launcher (``launchers``: subprocesses or Ray actors)
that each run ``worker_proc``."""
